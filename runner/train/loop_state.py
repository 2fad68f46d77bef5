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
    loss_sum: Optional[torch.Tensor] = None  # summed on device; read only at log steps
    loss_count: int = 0
    # The objective's further figures (MicroBatchLoss.metrics), summed like loss_sum (and
    # checkpointed like it: a resume inside a log window closes it with the same numbers).
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)
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
        same_layout = (
            len(sums) == plan.world_size
            and int(meta.get("grad_accum_steps", plan.grad_accum_steps)) == plan.grad_accum_steps
        )
        metric_sums = meta.get("pending_metric_sums") or {}
        if same_layout:  # this rank's own sum: the window closes bit-exactly
            s.loss_count = count
            s.loss_sum = torch.tensor(sums[accelerator.process_index], device=accelerator.device)
            s.metric_sums = {name: torch.tensor(values[accelerator.process_index], device=accelerator.device)
                             for name, values in metric_sums.items()}
        else:  # another layout: the window's mean micro-batch loss, over this layout's count
            old_accum = int(meta.get("grad_accum_steps", 1))
            s.loss_count = count // old_accum * plan.grad_accum_steps
            mean = sum(sums) / len(sums) / count
            s.loss_sum = torch.tensor(mean * s.loss_count, device=accelerator.device)
            s.metric_sums = {name: torch.tensor(sum(values) / len(values) / count * s.loss_count,
                                                device=accelerator.device) for name, values in metric_sums.items()}
