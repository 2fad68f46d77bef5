"""Resumable checkpoints, written atomically: a folder is complete or it is not there.

Accelerate's `save_state` writes model, optimizer, scheduler and RNG states (under
DDP and DeepSpeed alike) into a temporary folder; rank 0 then adds a completion
marker and renames it into place. Old checkpoints are pruned only after the new
one is complete (Accelerate's own `total_limit` deletes first).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from accelerate import Accelerator

CHECKPOINTS_DIRNAME = "checkpoints"
COMPLETE_MARKER = "COMPLETE.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIRNAME / f"step_{step}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first. A folder without the marker is ignored."""
    root = run_dir / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE_MARKER).exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(
    accelerator: "Accelerator", run_dir: Path, step: int, keep: int, extra: Optional[dict[str, Any]] = None
) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every rank takes part (DeepSpeed shards)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, **(extra or {})}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
