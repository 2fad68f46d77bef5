"""Which checkpoint a run resumes from, and whether the new spec may continue it.

Changes that break the math (model, data, global batch, strategy, world size,
optimizer, schedule, precision, seed) are refused; harmless ones (max_steps,
num_epochs, log/eval/save cadence, eval batch size, dataloader workers) are
accepted and reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from runner.config.batch import global_batch
from runner.config.errors import UserError
from runner.config.spec import SPEC_FILENAME, RunSpec, flat_spec_dict, load_spec
from runner.train.checkpoint import CHECKPOINTS_DIRNAME, is_complete, latest_checkpoint, read_marker

HARMLESS = (
    "train.max_steps", "train.num_epochs", "train.log_every", "train.eval_every", "train.save_every",
    "train.keep_checkpoints", "train.per_device_eval_batch_size", "train.dataloader_num_workers",
    "data.max_eval_samples", "data.cache_dir",
    "launch.max_restarts", "launch.rdzv_endpoint", "launch.rdzv_timeout", "launch.node_rank", "overwrite", "resume", "run_dir", "name",
    "sweep.parity_baseline",
    "train.deterministic",  # only which GPU kernels run: the same math, summed in a fixed order
)


LAYOUT_KEYS = ("train.grad_accum_steps", "train.global_batch_size", "train.per_device_batch_size",
               "launch.nproc_per_node", "launch.nnodes")


def _layout(spec: RunSpec, world: int) -> tuple[int, int, int]:
    return world, spec.train.per_device_batch_size, spec.train.grad_accum_steps


def layout_change_problems(
    old: RunSpec, new: RunSpec, old_world: int, new_world: int, train_samples: Optional[int], marker: dict
) -> list[str]:
    """Why a change of layout (processes x per-device batch x accumulation) at the same
    global batch cannot continue at the exact sample; empty when it can."""
    before, after = _layout(old, old_world), _layout(new, new_world)
    if before == after:
        return []
    shown = f"{'x'.join(map(str, before))} -> {'x'.join(map(str, after))} (processes x per-device batch x accumulation)"
    problems = []
    if old_world != new_world and old.strategy.kind.value != "ddp":
        problems.append(f"world size under {old.strategy.kind.value}: {old_world} -> {new_world} (ZeRO and FSDP shards are per rank)")
    if "samples_in_epoch" not in marker:
        problems.append(f"layout {shown}: this checkpoint predates sample-exact positions; resume it in its own layout")
    elif int(marker["samples_in_epoch"]) % (new_world * new.train.per_device_batch_size):
        problems.append(f"layout {shown}: the checkpoint's position ({marker['samples_in_epoch']} samples into the "
                        "epoch) is not a whole number of this layout's micro-batches")
    batch = global_batch(new.train, new_world)
    if train_samples is not None and train_samples % batch:
        # Accelerate pads and splits an epoch's short last step per layout: the steps
        # after the first epoch end would not be the ones the run would have taken.
        problems.append(f"layout {shown}: the {train_samples} training samples do not divide into global batches of "
                        f"{batch}, and each layout splits the short last step of an epoch its own way "
                        "(set data.max_train_samples to a multiple of the global batch, or keep the layout)")
    return problems


def compare(
    old: RunSpec, new: RunSpec, old_world: int, new_world: int,
    train_samples: Optional[int] = None, marker: Optional[dict] = None,
) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between the checkpoint's spec and this one."""
    a, b = flat_spec_dict(old), flat_spec_dict(new)
    breaking, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key in LAYOUT_KEYS:
            continue
        (harmless if key in HARMLESS else breaking).append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    old_batch, new_batch = global_batch(old.train, old_world), global_batch(new.train, new_world)
    if old_batch != new_batch:
        breaking.append(f"global batch: {old_batch} -> {new_batch}")
    else:
        breaking += layout_change_problems(old, new, old_world, new_world, train_samples, marker or {})
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


def check_resume(
    spec: RunSpec, run_dir: Path, world_size: int, train_samples: Optional[int] = None
) -> tuple[Optional[Path], list[str]]:
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

    marker = read_marker(path)
    breaking, harmless = compare(old, spec, int(marker.get("world_size", world_size)), world_size, train_samples, marker)
    if breaking:
        raise UserError(
            f"cannot resume {path}: these changes would break the run's math: {'; '.join(breaking)}. "
            "Undo them, or start a new run folder."
        )
    notes = [f"resuming from {path} (step {marker.get('step')})"]
    notes += [f"resume: accepted change {h}" for h in harmless]
    return path, notes
