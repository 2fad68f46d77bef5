"""The run folder: refuse to clobber results, then freeze the spec into it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from runner.config.errors import UserError
from runner.config.spec import SPEC_FILENAME, RunSpec, save_spec
from runner.distributed.strategies import build_strategy

# What a run writes. A folder holding any of these holds somebody's results.
RESULT_NAMES: tuple[str, ...] = (
    SPEC_FILENAME,
    "metrics.jsonl",
    "train_results.json",
    "eval_results.json",
    "all_results.json",
    "loss_curves.png",
    "model",
    "adapter",
    "benchmark_results.json",  # eval.tasks (runner/report/benchmarks.py)
    "benchmarks",
    "checkpoints",
    "abandoned",  # branches a resume from an older checkpoint set aside (runner/train/resume.py)
    "run.log",
    "tensorboard",
    ".hydra",
)


def existing_results(run_dir: Path) -> list[str]:
    return [name for name in RESULT_NAMES if (run_dir / name).exists()]


def prepare_run_dir(run_dir: Path, overwrite: bool, continuing: bool = False, why: str = "") -> None:
    """Refuse a folder that already holds results unless overwrite=true; with it,
    remove only what a run writes (never other files the user keeps there).

    `continuing`: a resume from one of this folder's own checkpoints, which carries
    its run on and removes nothing. Anything else (a fresh start, resume=auto that
    found no checkpoint, a checkpoint from another folder) would write over the
    results, so it is refused like a fresh run; `why` says which it was.
    """
    if continuing:
        run_dir.mkdir(parents=True, exist_ok=True)
        return
    found = existing_results(run_dir)
    if found and not overwrite:
        raise UserError(
            f"the run folder {run_dir} already holds results ({', '.join(found)}){why}. "
            "Pick a new folder (hydra.run.dir=PATH) or replace them with overwrite=true."
        )
    for name in found:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def first_missing(path: Path) -> Optional[Path]:
    """The outermost folder of `path` that does not exist yet: what creating `path` makes
    (None: it exists already, so nothing would be made)."""
    path = Path(path).absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_if_unused(run_dir: Path, made: Optional[Path]) -> None:
    """Remove `run_dir` and its parents up to `made` (what this process created for it,
    first_missing before it was made) while they are empty: a refused or dry run leaves
    no empty folder behind. Only rmdir, which fails on a folder with anything in it, and
    never above `made`: a folder that existed before stays."""
    if made is None:
        return
    run_dir = Path(run_dir).absolute()
    if made != run_dir and made not in run_dir.parents:
        return
    for folder in (run_dir, *run_dir.parents):
        try:
            if folder.exists():  # a dry run removes its own run folder (runner/launch/start.py)
                folder.rmdir()
        except OSError:  # something is in it: keep it and everything above
            return
        if folder == made:
            return


def continues_in_place(run_dir: Path, checkpoint: Optional[Path]) -> bool:
    """Whether resuming from `checkpoint` carries on the run that lives in `run_dir`: a
    checkpoint of its own (checkpoints/step_N) or of a branch it set aside
    (abandoned/X/checkpoints/step_N, which runner.train.resume.start_branch brings back).
    A copy kept anywhere else in the folder is another run's, like any other folder's."""
    if checkpoint is None or run_dir.resolve() not in checkpoint.resolve().parents:
        return False
    parts = checkpoint.resolve().relative_to(run_dir.resolve()).parts
    return parts[:1] == ("checkpoints",) and len(parts) == 2 or (
        len(parts) == 4 and parts[0] == "abandoned" and parts[2] == "checkpoints")


def freeze(spec: RunSpec, run_dir: Path, composed: object = None, overrides: Sequence[str] = (),
           notes: Sequence[str] = ()) -> Path:
    """Write run_spec.yaml (the single source of truth) and Hydra's record in .hydra/.
    `notes`: what the launcher decided that the keys do not say (how an auto micro-batch
    was chosen), as comments at the top beside the strategy's."""
    spec_path = run_dir / SPEC_FILENAME
    save_spec(spec, spec_path, notes=[*build_strategy(spec.strategy, spec.precision).notes(spec.optim.fused), *notes])
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    if composed is not None:
        (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(composed))
    (hydra_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return spec_path
