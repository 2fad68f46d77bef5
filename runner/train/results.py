"""What the loop reports: a metrics line per logging window, and train_results at the end
(run_clm's names). Figures are read on the host only here and in the per-step finite check."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from runner.report.metrics import MetricsWriter, current_memory_mb, window_peak_memory_mb
from runner.train.loop_state import LoopState, is_max
from runner.train.parts import LoopSettings, TrainData
from runner.train.plan import RunPlan


def postfix(record: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows beside its rate and ETA."""
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record.get("mfu") is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    shown["mem"] = f"{max(record['peak_memory_mb']):,.0f}MB"
    return shown


class Reports:
    def __init__(self, accelerator: Any, plan: RunPlan, state: LoopState, data: TrainData,
                 settings: LoopSettings) -> None:
        self.accelerator, self.plan, self.state, self.data, self.settings = accelerator, plan, state, data, settings
        self.metrics = MetricsWriter(
            settings.run_dir / "metrics.jsonl",
            accelerator.is_main_process,
            # Trackers start after a resume is known (worker.tracker_kwargs); none: log() does nothing.
            tracker_log=lambda values, step: accelerator.log(values, step=step),
        )
        self.logged_real_tokens = 0  # real tokens at the last log line (data.counts_real_tokens)
        self.metric_means: dict[str, float] = {}  # the objective's further figures over the last loss window

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        if not self.settings.peak_flops or not tokens_per_s == tokens_per_s:  # unknown peak, or NaN rate
            return None
        return tokens_per_s * self.settings.flops_per_token / self.settings.peak_flops

    def close_loss_window(self, window_steps: int) -> float:
        """Mean loss since the last log, averaged over ranks, added to the run's total."""
        s = self.state
        assert s.loss_sum is not None
        mean = self.accelerator.reduce(s.loss_sum / s.loss_count, reduction="mean").item()
        s.total_loss += mean * window_steps
        s.total_loss_steps += window_steps
        self.metric_means = {name: self._over_ranks(name, value, s.loss_count) for name, value in s.metric_sums.items()}
        s.loss_sum, s.loss_count, s.metric_sums = None, 0, {}
        return mean

    def _over_ranks(self, name: str, value: torch.Tensor, steps: int) -> float:
        """A figure of the window: the ranks' mean of its mean over the steps, or for a
        `.../max` figure the largest any rank saw."""
        if is_max(name):
            return self.accelerator.gather(value.float().reshape(1)).max().item()
        return self.accelerator.reduce(value / steps, reduction="mean").item()

    def log_step(self, window_steps: int, elapsed: float, grad_norm: Optional[torch.Tensor], lr: float,
                 loss_scale: Optional[float]) -> dict[str, Any]:
        """One metrics line: the window's loss and rates. `window_steps` counts the steps
        this process ran in the window (for the rates); after a resume inside a window the
        loss window also holds the steps from before the checkpoint."""
        s, plan = self.state, self.plan
        mean = self.close_loss_window(s.step - s.total_loss_steps)
        rate = window_steps / elapsed if elapsed > 0 else float("nan")
        if self.data.counts_real_tokens:  # padding is not counted
            trained = s.real_tokens_so_far()
            tokens_per_s = (trained - self.logged_real_tokens) / elapsed if elapsed > 0 else float("nan")
            self.logged_real_tokens = trained
        else:
            tokens_per_s = rate * plan.tokens_per_step
        device = self.accelerator.device
        memory = self.accelerator.gather(torch.tensor([[window_peak_memory_mb(device), current_memory_mb(device)]], device=device))
        record = {
            "step": s.step,
            # a stream's passes so far (its length is unknown until read through)
            "epoch": s.epoch if self.data.stream else round(s.epoch + min(s.samples_in_epoch / max(plan.train_blocks, 1), 1.0), 4),
            "loss": mean,
            **self.metric_means,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": rate * plan.global_batch_size,
            "mfu": self.mfu(tokens_per_s),
            "peak_memory_mb": [round(float(v), 1) for v in memory[:, 0].cpu()],  # one per rank, this window (GPU)
            "memory_mb": [round(float(v), 1) for v in memory[:, 1].cpu()],  # held now, one per rank
        }
        if loss_scale is not None:
            record.update(loss_scale=loss_scale, skipped_steps=s.skipped_steps)
        self.metrics.write(record)
        return record

    def train_results(self, runtime: float, data_wait: float, first_batch_wait: Optional[float]) -> dict[str, Any]:
        s, plan = self.state, self.plan
        if s.loss_count:  # steps since the last log
            self.close_loss_window(s.step - s.total_loss_steps)
        train_loss = s.total_loss / s.total_loss_steps if s.total_loss_steps else math.nan
        samples = s.step * plan.global_batch_size
        # Rates count only the steps this process ran, over the time it ran them: after
        # a resume, the steps before the checkpoint took time this process never saw.
        steps_run = s.step - s.start_step
        first = first_batch_wait or 0.0
        samples_run = steps_run * plan.global_batch_size
        tokens_run = samples_run * plan.block_size
        tokens: Optional[int] = samples * plan.block_size
        if self.data.counts_real_tokens:  # real tokens, not the rows' capacity
            tokens_run = s.real_tokens_so_far() - (s.real_tokens_at_start or 0)
            tokens = None if s.real_tokens_at_start is None else s.real_tokens_so_far()
        return {
            "epoch": s.epoch if self.data.stream else round(s.step / max(plan.steps_per_epoch, 1), 4),
            "train_loss": train_loss,
            "train_runtime": round(runtime, 3),
            "train_samples": samples,
            "train_steps": s.step,
            "train_tokens": tokens,
            "resumed_from_step": s.start_step,
            # None, not 0.0, when this process ran no step (resumed at the last one): no rate was measured.
            "train_samples_per_second": round(samples_run / runtime, 3) if steps_run else None,
            "train_steps_per_second": round(steps_run / runtime, 3) if steps_run else None,
            "train_tokens_per_second": round(tokens_run / runtime, 1) if steps_run else None,
            "train_mfu": self.mfu(tokens_run / runtime) if steps_run else None,
            "first_step_time": s.first_step_time,
            # waiting for training batches after the first, as a share of the training time after it
            # (bench/stream_data.py); the first batch's wait is the data's start-up
            "data_wait_seconds": round(data_wait, 3),
            "data_wait_fraction": round(data_wait / (runtime - first), 4) if runtime - first > 0 else None,
            "first_batch_seconds": round(first, 3),
        }
