"""Resumable checkpoints, written atomically: a folder is complete or it is not there.

Accelerate's `save_state` writes model, optimizer, scheduler and RNG states (under
DDP and DeepSpeed alike) into a temporary folder; rank 0 then adds a completion
marker and renames it into place. Old checkpoints are pruned only after the new
one is complete (Accelerate's own `total_limit` deletes first).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator

from runner.config.errors import UserError
from runner.train.rng import restore_random_states

log = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
COMPLETE_MARKER = "COMPLETE.json"


# Called on every rank, at the same steps, once a checkpoint is complete: (its folder, the
# loop's figures at it). A launch engine that keeps its own account of the checkpoints
# registers one (Ray Train's report, runner/launch/ray_engine.py); train/ imports nothing
# of it (imports point down), and a run without one is unchanged.
CheckpointHook = Callable[[Path, dict[str, Any]], None]
_hooks: list[CheckpointHook] = []


def add_checkpoint_hook(hook: CheckpointHook) -> Callable[[], None]:
    """Register `hook` for the checkpoints this process saves; returns its removal."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook) if hook in _hooks else None


def checkpoint_saved(path: Path, figures: dict[str, Any]) -> None:
    """Every rank, after a checkpoint is complete (a collective for hooks that report)."""
    for hook in list(_hooks):
        hook(path, figures)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIRNAME / f"step_{step}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A folder without the marker is ignored."""
    root = run_dir / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE_MARKER).exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    accelerator: "Accelerator",
    run_dir: Path,
    step: int,
    keep: int,
    extra: Optional[dict[str, Any]] = None,
    spec_yaml: str = "",
    rank_state: Optional[dict[str, Any]] = None,
) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every rank takes part (DeepSpeed shards)
    if rank_state is not None:  # each rank's own (a stream's position): Accelerate saves custom state on rank 0 only
        torch.save(rank_state, tmp / rank_state_file(accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if spec_yaml:
            (tmp / "run_spec.yaml").write_text(spec_yaml)  # what a resume is checked against
        # The marker is written last: a folder without it is never loaded.
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, **(extra or {})}, indent=2))
        if is_complete(final):  # another branch's step_N (a resume sets newer ones aside first): keep it
            kept = run_dir / "abandoned" / f"replaced_{final.name}_{time.strftime('%Y%m%dT%H%M%S')}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            final.rename(kept)
            log.warning(f"runner: a complete {final.name} was in the way of this run's; moved it to {kept}")
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one: never loaded
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def rank_state_file(rank: int) -> str:
    return f"rank_state_{rank}.pt"


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    """A rank's own state saved with a checkpoint; a missing or torn file is named."""
    file = path / rank_state_file(rank)
    try:
        return torch.load(file, weights_only=False)  # written by save_checkpoint: plain dicts and numbers
    except Exception as err:  # noqa: BLE001 - missing, truncated or tampered
        raise UserError(f"checkpoint {path}: rank {rank}'s data position {file.name} is unreadable "
                        f"({type(err).__name__}). Resume from an older checkpoint (resume=PATH) or start a new run.") from None


def read_marker(path: Path) -> dict[str, Any]:
    """The loop state saved with a checkpoint; a damaged marker is a clear error."""
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
            raise ValueError("no step in it")
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        older = [p.name for p in complete_checkpoints(path.parent) if p != path]
        hint = f"resume=PATH with an older one ({', '.join(older[-2:])})" if older else "resume=PATH with another checkpoint"
        raise UserError(
            f"checkpoint {path}: its {COMPLETE_MARKER} is damaged ({type(err).__name__}: {err}). "
            f"Resume from an older checkpoint ({hint}) or start a new run folder."
        ) from None
    return marker


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE_MARKER).is_file()


def load_checkpoint(accelerator: "Accelerator", path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states; returns the loop state saved with them."""
    meta = read_marker(path)
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # a truncated or tampered file: never continue half-restored
        raise UserError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            f"Resume from an older one (resume=PATH) or start a new run."
        ) from None
    # load_state only logs a random state it could not read; this raises, naming the file.
    restore_random_states(path, accelerator.process_index, int(meta.get("world_size", accelerator.num_processes)))
    return meta
