"""The loop's own state, and how a checkpoint records and restores it (the model,
optimizer, scheduler and random states are Accelerate's and the strategy's:
runner/train/checkpoint.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from runner.train.plan import RunPlan


@dataclass
class LoopState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    # The data position: samples of this epoch's global order already trained on. In
    # samples, not per-rank batches, so a resume in another layout at the same global
    # batch continues at the same sample (Accelerate hands rank r batches r, r+N, ...).
    samples_in_epoch: int = 0
    start_step: int = 0  # the step this process started from (> 0 after a resume)
    # The log window's figures: each step's mean over its micro-batches, summed over the
    # window's steps (on device; read only at log steps), so the window's figure is the mean
    # of its steps and an epoch's short last step weighs as much as a whole one.
    loss_sum: Optional[torch.Tensor] = None
    loss_count: int = 0  # steps in the window
    # The objective's further figures (MicroBatchLoss.metrics), summed like loss_sum (and
    # checkpointed like it: a resume inside a log window closes it with the same numbers).
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    # The step under way: its micro-batches' figures summed, and how many (a checkpoint
    # falls between steps: these are never saved).
    step_sum: Optional[torch.Tensor] = None
    step_micro_batches: int = 0
    step_metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    total_loss: float = 0.0  # mean-of-steps train loss, like the HF Trainer's train_loss
    total_loss_steps: int = 0
    skipped_steps: int = 0  # fp16 overflows: the step was skipped and the loss scale lowered
    consecutive_skips: int = 0  # skipped steps since the last step taken (precision.max_consecutive_skipped_steps)
    first_step_time: Optional[float] = None  # wall clock (time.time()) when step 1 finished, for benchmarks
    last_eval: dict[str, float] = field(default_factory=dict)
    # Runs whose rows hold padding (instruction data): the tokens trained so far that are
    # not padding, on all ranks (on the device, read at log steps), and how many of them
    # came before this process started; None when a checkpoint did not record them.
    real_tokens: Optional[torch.Tensor] = None
    real_tokens_at_start: Optional[int] = 0

    def real_tokens_so_far(self) -> int:
        """Tokens trained so far that are not padding (reads the device)."""
        return 0 if self.real_tokens is None else int(self.real_tokens)


# A figure named `.../max` (MicroBatchLoss.metrics) is a maximum, not a mean: over the
# step's micro-batches, the window's steps and the ranks alike.
MAX_SUFFIX = "/max"


def is_max(name: str) -> bool:
    return name.endswith(MAX_SUFFIX)


def _add(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    if name not in sums:
        sums[name] = value
    else:
        sums[name] = torch.maximum(sums[name], value) if is_max(name) else sums[name] + value


def add_micro_batch(state: LoopState, logged: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
    """A micro-batch's logged loss and figures, into the step under way."""
    s = state
    s.step_sum = logged if s.step_sum is None else s.step_sum + logged
    s.step_micro_batches += 1
    for name, value in metrics.items():
        _add(s.step_metric_sums, name, value.float())


def close_step(state: LoopState) -> None:
    """The step's figures (the mean over its micro-batches) into the log window."""
    s = state
    if s.step_sum is None:
        return
    count = s.step_micro_batches
    s.loss_sum = s.step_sum / count if s.loss_sum is None else s.loss_sum + s.step_sum / count
    s.loss_count += 1
    for name, value in s.step_metric_sums.items():
        _add(s.metric_sums, name, value if is_max(name) else value / count)
    s.step_sum, s.step_micro_batches, s.step_metric_sums = None, 0, {}


def checkpoint_meta(state: LoopState, plan: RunPlan, accelerator: Any, counts_real_tokens: bool) -> dict[str, Any]:
    """What a checkpoint records of the loop (every rank takes part: a gather)."""
    s = state
    # Each rank's own running loss sum, so a resume inside a logging window closes
    # that window with the very same numbers (a mean over ranks would round).
    pending = torch.zeros(1, device=accelerator.device) if s.loss_sum is None else s.loss_sum.reshape(1)
    pending_sums = [float(v) for v in accelerator.gather(pending.float()).cpu()]
    # The objective's further figures (a preference run's rewards/*) likewise, each rank's own
    names = sorted(s.metric_sums)
    metric_sums: dict[str, list[float]] = {}
    if names:
        stacked = torch.stack([s.metric_sums[name].float().reshape(()) for name in names]).reshape(1, -1)
        per_rank = accelerator.gather(stacked).cpu()
        metric_sums = {name: [float(v) for v in per_rank[:, i]] for i, name in enumerate(names)}
    meta = {
        "epoch": s.epoch,
        "samples_in_epoch": s.samples_in_epoch,
        "world_size": accelerator.num_processes,
        "per_device_batch_size": plan.per_device_batch_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "total_steps": plan.total_steps,  # a resume=auto at or past it finds the run finished
        "steps_per_epoch": plan.steps_per_epoch,
        "total_loss": s.total_loss,
        "total_loss_steps": s.total_loss_steps,
        "pending_loss_sums": pending_sums,
        "pending_loss_count": s.loss_count,
        "pending_loss_counts": "steps",  # before: micro-batches, each step weighed by its number of them
        "pending_metric_sums": metric_sums,
        "skipped_steps": s.skipped_steps,
    }
    if counts_real_tokens:
        meta["real_tokens"] = s.real_tokens_so_far()
    return meta


def restore_loop_state(state: LoopState, meta: dict[str, Any], plan: RunPlan, accelerator: Any,
                       counts_real_tokens: bool, samples_per_batch: int) -> None:
    """Continue from a checkpoint's loop state (`checkpoint_meta`)."""
    s = state
    s.step, s.epoch = int(meta["step"]), int(meta["epoch"])
    s.start_step = s.step
    if "samples_in_epoch" in meta:
        s.samples_in_epoch = int(meta["samples_in_epoch"])
    else:  # checkpoints before the position was kept in samples: same layout only
        s.samples_in_epoch = int(meta["batches_in_epoch"]) * samples_per_batch
    s.total_loss, s.total_loss_steps = float(meta["total_loss"]), int(meta["total_loss_steps"])
    s.skipped_steps = int(meta.get("skipped_steps", 0))
    if counts_real_tokens:  # a checkpoint from before real tokens were counted: rates only
        before = meta.get("real_tokens")
        s.real_tokens_at_start = None if before is None else int(before)
        s.real_tokens = torch.tensor(s.real_tokens_at_start or 0, dtype=torch.int64, device=accelerator.device)
    count = int(meta.get("pending_loss_count", 0))
    if count:
        sums = meta.get("pending_loss_sums") or [float(meta["pending_loss_sum"])]
        metric_sums = meta.get("pending_metric_sums") or {}
        by_steps = meta.get("pending_loss_counts") == "steps"
        same_layout = by_steps and len(sums) == plan.world_size
        if same_layout:  # this rank's own sum: the window closes bit-exactly
            s.loss_count = count
            s.loss_sum = torch.tensor(sums[accelerator.process_index], device=accelerator.device)
            s.metric_sums = {name: torch.tensor(values[accelerator.process_index], device=accelerator.device)
                             for name, values in metric_sums.items()}
        else:
            # Another number of ranks: each gets the ranks' mean sum (the window's mean over
            # ranks is what it closes with). A checkpoint that counted micro-batches: its
            # window's mean as that many steps' worth (its steps were whole but the last).
            steps = count if by_steps else -(-count // int(meta.get("grad_accum_steps", 1)))
            scale = 1.0 if by_steps else steps / count
            s.loss_count = steps
            s.loss_sum = torch.tensor(sum(sums) / len(sums) * scale, device=accelerator.device)
            s.metric_sums = {name: torch.tensor(max(values) if is_max(name) else sum(values) / len(values) * scale,
                                                device=accelerator.device)
                             for name, values in metric_sums.items()}
