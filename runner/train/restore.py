"""Setup step 7: each rank's random state, and a checkpoint restored into the run being set
up (resume=auto|PATH, or the newest checkpoint after a restart under launch.max_restarts):
through Accelerate's load_state in the layout and strategy that wrote it, else read across
(runner/train/reshard.py); metrics.jsonl cut back to the step the run continues from.
Last in the setup, so nothing setup drew moves dropout's stream (runner/train/rng.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from accelerate import Accelerator

from runner.components.adapters import adapter_dropout
from runner.components.model import active_dropout
from runner.components.optim import follow_plan
from runner.config.spec import SPEC_FILENAME, RunSpec, load_spec
from runner.train.checkpoint import latest_checkpoint, load_checkpoint, read_marker
from runner.train.ledger import restart_count
from runner.train.plan import RunPlan
from runner.train.reshard import load_across, needs_reshard
from runner.train.rl_setup import COMPLETIONS_FILENAME
from runner.train.resume import Recorded, recorded_at_end, resolve
from runner.train.rng import seed_training_stream
from runner.train.trainer import Trainer

log = logging.getLogger("runner")


def restore_random_state(spec: RunSpec, accelerator: Accelerator, trainer: Trainer, run_dir: Path,
                         config: Any) -> Recorded:
    """Each rank's random state: seeded here for the loop, saved with every checkpoint,
    and restored from one after all setup (see runner/train/rng.py). Returns what the
    folder already holds for the last step when the resume lands on it (no step to run)."""
    seed_training_stream(spec.train.seed)
    resume_from = _resume_point(spec, run_dir)
    recorded = Recorded()
    if resume_from is not None:
        meta = load_resume_point(spec, accelerator, trainer, resume_from)
        trainer.restore(meta, resume_from)
        if trainer.state.step >= trainer.plan.total_steps:  # rank 0's reading, so every rank skips the same collectives
            found = [recorded_at_end(run_dir, trainer.state.step, load_spec(resume_from / SPEC_FILENAME), spec,
                                     trainer.plan.eval_blocks) if accelerator.is_main_process else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(found, src=0)
            recorded = found[0]
            trainer.final_eval = recorded.evaluation
        if accelerator.is_main_process:
            log.info(f"resumed from {resume_from} at step {trainer.state.step}")
            note = inexact_layout_note(meta, trainer.plan, {**active_dropout(config), **adapter_dropout(spec.peft)})
            if note:
                log.warning(f"runner: note: {note}")
            if recorded.note(trainer.state.step):
                log.info(recorded.note(trainer.state.step))
    if accelerator.is_main_process:
        # Lines past the step this run starts from are logged again: after a resume, or
        # after a restart (launch.max_restarts) of an attempt that died before its first
        # checkpoint. metrics.jsonl then holds each step once.
        truncate_metrics(run_dir / "metrics.jsonl", trainer.state.step,
                         final_eval_again=trainer.state.step >= trainer.plan.total_steps and recorded.evaluation is None)
        truncate_metrics(run_dir / COMPLETIONS_FILENAME, trainer.state.step)  # online RL's samples, by the same steps
    return recorded


def load_resume_point(spec: RunSpec, accelerator: Accelerator, trainer: Trainer, checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's states into this run: through Accelerate's load_state in the layout
    and strategy that wrote it, else read across (runner/train/reshard.py; the launcher
    has already refused what cannot be)."""
    old = load_spec(checkpoint / SPEC_FILENAME)
    old_world = int(read_marker(checkpoint).get("world_size", accelerator.num_processes))
    if accelerator.is_main_process and old.strategy.kind != spec.strategy.kind:
        log.warning(f"runner: note: the strategy changed ({old.strategy.kind.value} -> {spec.strategy.kind.value}): "
                    "it sums in another order, so the continuation matches an uninterrupted run within float "
                    "rounding, not bit for bit.")
    if not needs_reshard(old.strategy.kind.value, spec.strategy.kind.value, old_world, accelerator.num_processes):
        meta = load_checkpoint(accelerator, checkpoint)
    else:
        if accelerator.is_main_process:
            log.info(f"resume: reading {checkpoint.name} of {old_world} processes under {old.strategy.kind.value} into "
                     f"{accelerator.num_processes} under {spec.strategy.kind.value} (runner/train/reshard.py)")
        meta = load_across(accelerator, checkpoint, old.strategy.kind.value, spec.strategy.kind.value, trainer.model,
                           trainer.optimizer, trainer.scheduler, spec.optim.weight_decay, trainer.run_dir)
    follow_plan(trainer.scheduler)  # the loaded rate is the checkpoint's plan's; the steps ahead follow this run's
    return meta


def _resume_point(spec: RunSpec, run_dir: Path) -> Optional[Path]:
    """resume=auto|PATH, or after a crash restart (launch.max_restarts) the newest checkpoint."""
    if restart_count() > 0:
        return latest_checkpoint(run_dir)
    return resolve(spec, run_dir)


def inexact_layout_note(meta: dict[str, Any], plan: RunPlan, dropout: dict[str, float]) -> Optional[str]:
    """Why a resume in another layout cannot be exact, when dropout is on: each rank
    draws masks for its own micro-batch shape, so another per-rank batch draws other
    masks (the samples, the global batch and the math are still the same)."""
    saved = (int(meta.get("world_size", plan.world_size)), int(meta.get("per_device_batch_size", plan.per_device_batch_size)),
             int(meta.get("grad_accum_steps", plan.grad_accum_steps)))
    now = (plan.world_size, plan.per_device_batch_size, plan.grad_accum_steps)
    if saved == now or not dropout:
        return None
    shown = ", ".join(f"{k}={v:g}" for k, v in sorted(dropout.items()))
    return (f"the layout changed ({'x'.join(map(str, saved))} -> {'x'.join(map(str, now))}, processes x per-device batch x "
            f"accumulation) with dropout on ({shown}): the dropout masks differ from an uninterrupted run's, so this "
            "continuation is statistically equivalent, not exact. Keep the layout for an exact resume.")


def truncate_metrics(path: Path, step: int, final_eval_again: bool = False) -> None:
    """Drop lines logged after the checkpoint: the resumed run logs those steps again.
    `final_eval_again`: the checkpoint is the last step, whose evaluation (logged after
    the checkpoint was written) the resumed run repeats."""
    if not path.exists():
        return

    def kept(line: str) -> bool:
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by kill -9 mid-write
            return False
        if final_eval_again and "eval_loss" in row and row.get("step", 0) >= step:
            return False
        return row.get("step", 0) <= step

    keep = [line for line in path.read_text().splitlines() if line.strip() and kept(line)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
