"""Which checkpoint a run resumes from, and whether the new spec may continue it.

Changes that break the math (model, data, global batch, strategy, world size,
optimizer, schedule, precision, seed) are refused; harmless ones (max_steps,
num_epochs, log/eval/save cadence, eval batch size, dataloader workers) are
accepted and reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from runner.checkpoint import CHECKPOINTS_DIRNAME, is_complete, latest_checkpoint
from runner.errors import UserError
from runner.plan import global_batch
from runner.spec import SPEC_FILENAME, RunSpec, flat_spec_dict, load_spec

HARMLESS = (
    "train.max_steps", "train.num_epochs", "train.log_every", "train.eval_every", "train.save_every",
    "train.keep_checkpoints", "train.per_device_eval_batch_size", "train.dataloader_num_workers",
    "data.max_eval_samples", "data.preprocessing_num_workers", "data.cache_dir",
    "launch.max_restarts", "launch.rdzv_endpoint", "launch.rdzv_timeout", "launch.node_rank", "overwrite", "resume", "run_dir", "name",
)


def compare(old: RunSpec, new: RunSpec, old_world: int, new_world: int) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between the checkpoint's spec and this one."""
    a, b = flat_spec_dict(old), flat_spec_dict(new)
    breaking, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key in ("train.grad_accum_steps", "train.global_batch_size", "train.per_device_batch_size",
                                              "launch.nproc_per_node", "launch.nnodes"):
            continue
        (harmless if key in HARMLESS else breaking).append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    old_batch, new_batch = global_batch(old.train, old_world), global_batch(new.train, new_world)
    if old_batch != new_batch:
        breaking.append(f"global batch: {old_batch} -> {new_batch}")
    if old_world != new_world and old.strategy.kind.value != "ddp":
        breaking.append(f"world size under {old.strategy.kind.value}: {old_world} -> {new_world} (ZeRO shards are per rank)")
    return breaking, harmless


def resolve(spec: RunSpec, run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from (None: start fresh). Raises when one was named but
    cannot be used; never silently starts fresh when a usable one exists."""
    if spec.resume is None:
        return None
    if spec.resume != "auto":
        path = Path(spec.resume).expanduser().resolve()
        if not is_complete(path):
            raise UserError(f"resume={spec.resume}: not a complete checkpoint (no COMPLETE.json marker in it).")
        return path
    return latest_checkpoint(run_dir)


def describe_fresh_start(run_dir: Path) -> str:
    partial = sorted((run_dir / CHECKPOINTS_DIRNAME).glob(".tmp_step_*")) if (run_dir / CHECKPOINTS_DIRNAME).is_dir() else []
    if partial:
        return f"resume=auto: no complete checkpoint in {run_dir} (only an interrupted save, {partial[-1].name}); starting fresh."
    return f"resume=auto: no checkpoint in {run_dir}; starting fresh."


def check_resume(spec: RunSpec, run_dir: Path, world_size: int) -> tuple[Optional[Path], list[str]]:
    """Launcher-side: the checkpoint and notes to print, or a UserError naming what changed."""
    path = resolve(spec, run_dir)
    if path is None:
        return None, ([describe_fresh_start(run_dir)] if spec.resume == "auto" else [])
    saved_spec = path / SPEC_FILENAME
    if not saved_spec.is_file():
        raise UserError(f"checkpoint {path} has no {SPEC_FILENAME}; it cannot be checked against this run.")
    try:
        old = load_spec(saved_spec)
    except Exception as err:
        raise UserError(f"checkpoint {path}: its {SPEC_FILENAME} is unreadable ({err}).") from None
    from runner.checkpoint import read_marker

    marker = read_marker(path)
    breaking, harmless = compare(old, spec, int(marker.get("world_size", world_size)), world_size)
    if breaking:
        raise UserError(
            f"cannot resume {path}: these changes would break the run's math: {'; '.join(breaking)}. "
            "Undo them, or start a new run folder."
        )
    notes = [f"resuming from {path} (step {marker.get('step')})"]
    notes += [f"resume: accepted change {h}" for h in harmless]
    return path, notes
