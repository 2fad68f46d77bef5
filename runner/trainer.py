"""The generic training loop: accumulate, backward, clip, step, log, evaluate, checkpoint.

Objects come in already built and prepared (see runner/worker.py); this module
only runs them. `fit` reads top to bottom; the detail lives in `train_step`,
`evaluate` and `_log_step`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from runner.checkpoint import checkpoint_dir, latest_checkpoint, save_checkpoint
from runner.metrics import MetricsWriter, Progress, current_memory_mb, perplexity, window_peak_memory_mb
from runner.plan import RunPlan
from runner.signals import StopRequest, Stopped

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

log = logging.getLogger("runner")


def _postfix(record: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows beside its rate and ETA."""
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record.get("mfu") is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    shown["mem"] = f"{max(record['peak_memory_mb']):,.0f}MB"
    return shown


class NonFiniteLoss(RuntimeError):
    """A NaN or inf loss or gradient norm: the run stops before the optimizer step."""


@dataclass
class LoopState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch (the data position)
    loss_sum: Optional[torch.Tensor] = None  # summed on device; read only at log steps
    loss_count: int = 0
    total_loss: float = 0.0  # mean-of-steps train loss, like the HF Trainer's train_loss
    total_loss_steps: int = 0
    skipped_steps: int = 0  # fp16 overflows: the step was skipped and the loss scale lowered
    first_step_time: Optional[float] = None  # wall clock (time.time()) when step 1 finished, for benchmarks
    last_eval: dict[str, float] = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        accelerator: "Accelerator",
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        train_loader: "DataLoader",
        eval_loader: "DataLoader",
        plan: RunPlan,
        run_dir: Path,
        *,
        max_grad_norm: float,
        log_every: int,
        eval_every: int,
        save_every: int,
        keep_checkpoints: int,
        sampler: Any = None,
        spec_yaml: str = "",
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
    ) -> None:
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.plan = plan
        self.run_dir = run_dir
        self.max_grad_norm = max_grad_norm
        self.log_every, self.eval_every, self.save_every = log_every, eval_every, save_every
        self.keep_checkpoints = keep_checkpoints
        self.state = LoopState()
        self.metrics = MetricsWriter(
            run_dir / "metrics.jsonl",
            accelerator.is_main_process,
            tracker_log=(lambda values, step: accelerator.log(values, step=step)) if accelerator.trackers else None,
        )
        self.grad_norm: Optional[torch.Tensor] = None
        self.sampler = sampler
        self.spec_yaml = spec_yaml  # saved into each checkpoint, to check a resume against
        self.stop = StopRequest()
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # all devices together
        self.last_checkpoint: Optional[Path] = None

    # ------------------------------------------------------------------ loop
    def fit(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Train to plan.total_steps, evaluate at the end; returns (train, eval) results."""
        plan, s = self.plan, self.state
        progress = Progress(plan.total_steps, self.accelerator.is_main_process, initial=s.step)
        started = window_start = time.perf_counter()
        window_steps = 0
        self.model.train()
        self.stop.install()
        try:
            while s.step < plan.total_steps:
                for batch in self._epoch_batches():
                    s.batches_in_epoch += 1
                    if not self.train_step(batch):
                        continue
                    window_steps += 1
                    if self.log_every and s.step % self.log_every == 0:
                        record = self._log_step(window_steps, time.perf_counter() - window_start)
                        progress.update(0, **_postfix(record))
                        window_start, window_steps = time.perf_counter(), 0
                    progress.update(1)
                    if self.eval_every and s.step % self.eval_every == 0 and s.step < plan.total_steps:
                        self._evaluate_and_log(progress)
                    if self.save_every and s.step % self.save_every == 0:
                        self.save_checkpoint()
                    self._stop_if_signalled()
                    if s.step >= plan.total_steps:
                        break
                else:
                    s.epoch, s.batches_in_epoch = s.epoch + 1, 0
        finally:
            self.stop.restore()
            progress.close()
        runtime = time.perf_counter() - started
        eval_results = self._evaluate_and_log(None)
        return self._train_results(runtime), eval_results

    def _epoch_batches(self) -> Any:
        """This epoch's batches from the current data position (exact after a resume)."""
        loader = self.train_loader
        if self.state.batches_in_epoch:
            loader = self.accelerator.skip_first_batches(self.train_loader, self.state.batches_in_epoch)
        # Accelerate's loaders set their sampler's epoch from their own pass count at
        # each __iter__; a resumed (or skipping) loader must be told the real epoch.
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.state.epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(self.state.epoch)
        return loader

    def _stop_if_signalled(self) -> None:
        signum = self.stop.agreed(self.accelerator)
        if signum is None:
            return
        path = self.save_checkpoint() if self.last_checkpoint != self._checkpoint_path() else self.last_checkpoint
        raise Stopped(signum, self.state.step, str(path))

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_path(self) -> Path:
        return checkpoint_dir(self.run_dir, self.state.step)

    def save_checkpoint(self) -> Path:
        s = self.state
        pending = float(self.accelerator.reduce(s.loss_sum, reduction="mean").item()) if s.loss_sum is not None else 0.0
        meta = {
            "epoch": s.epoch,
            "batches_in_epoch": s.batches_in_epoch,
            "world_size": self.accelerator.num_processes,
            "total_loss": s.total_loss,
            "total_loss_steps": s.total_loss_steps,
            "pending_loss_sum": pending,
            "pending_loss_count": s.loss_count,
            "skipped_steps": s.skipped_steps,
        }
        self.last_checkpoint = save_checkpoint(
            self.accelerator, self.run_dir, s.step, self.keep_checkpoints, meta, spec_yaml=self.spec_yaml
        )
        return self.last_checkpoint

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's loop state (model and optimizer are already loaded)."""
        s = self.state
        s.step, s.epoch, s.batches_in_epoch = int(meta["step"]), int(meta["epoch"]), int(meta["batches_in_epoch"])
        s.total_loss, s.total_loss_steps = float(meta["total_loss"]), int(meta["total_loss_steps"])
        s.skipped_steps = int(meta.get("skipped_steps", 0))
        if meta.get("pending_loss_count"):
            s.loss_count = int(meta["pending_loss_count"])
            s.loss_sum = torch.tensor(float(meta["pending_loss_sum"]), device=self.accelerator.device)

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: dict[str, torch.Tensor]) -> bool:
        """One micro-batch; returns True when it completed an optimizer step."""
        acc, s = self.accelerator, self.state
        with acc.accumulate(self.model):
            loss = self.model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                self._check_finite(loss)
            self.optimizer.step()
            if acc.sync_gradients and not acc.optimizer_step_was_skipped:
                # Stepped here, once per optimizer step, never by Accelerate per process.
                self.scheduler.step()
            elif acc.sync_gradients:
                s.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
        detached = loss.detach().float()
        s.loss_sum = detached if s.loss_sum is None else s.loss_sum + detached
        s.loss_count += 1
        if not acc.sync_gradients:
            return False
        s.step += 1
        if s.first_step_time is None:
            s.first_step_time = time.time()
        return True

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Stop before the optimizer step on a NaN/inf loss or gradient norm (one host
        sync per optimizer step). The norm is global, so every rank stops together."""
        if self.max_grad_norm > 0:
            self.grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        checks = [loss.detach().float().reshape(1)]
        if self.grad_norm is not None:
            checks.append(torch.as_tensor(self.grad_norm, device=loss.device).float().reshape(1))
        if bool(torch.isfinite(torch.cat(checks)).all()):
            return
        if self.accelerator.mixed_precision == "fp16":
            return  # the loss scaler skips this step and lowers the scale: expected, not fatal
        step = self.state.step + 1
        last = self.last_checkpoint or latest_checkpoint(self.run_dir)
        where = f"the last good checkpoint is {last}" if last else "there is no checkpoint yet"
        raise NonFiniteLoss(
            f"non-finite loss or gradient norm at step {step} (loss {loss.item()}, grad norm "
            f"{float(self.grad_norm) if self.grad_norm is not None else 'n/a'}); stopped before the optimizer step; {where}. "
            "Lower optim.lr, raise schedule.warmup_steps, or use precision=fp32."
        )

    def _close_loss_window(self, window_steps: int) -> float:
        """Mean loss since the last log, averaged over ranks, added to the run's total."""
        s = self.state
        assert s.loss_sum is not None
        mean = self.accelerator.reduce(s.loss_sum / s.loss_count, reduction="mean").item()
        s.total_loss += mean * window_steps
        s.total_loss_steps += window_steps
        s.loss_sum, s.loss_count = None, 0
        return mean

    def _log_step(self, window_steps: int, elapsed: float) -> dict[str, Any]:
        """One metrics line: the window's loss and rates (read on the host only here and
        in the per-step finite check)."""
        s, plan = self.state, self.plan
        mean = self._close_loss_window(window_steps)
        rate = window_steps / elapsed if elapsed > 0 else float("nan")
        tokens_per_s = rate * plan.tokens_per_step
        device = self.accelerator.device
        memory = self.accelerator.gather(torch.tensor([[window_peak_memory_mb(device), current_memory_mb(device)]], device=device))
        record = {
            "step": s.step,
            "epoch": round(s.epoch + s.batches_in_epoch / max(len(self.train_loader), 1), 4),
            "loss": mean,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.grad_norm) if self.grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": rate * plan.global_batch_size,
            "mfu": self.mfu(tokens_per_s),
            "peak_memory_mb": [round(float(v), 1) for v in memory[:, 0].cpu()],  # one per rank, this window (GPU)
            "memory_mb": [round(float(v), 1) for v in memory[:, 1].cpu()],  # held now, one per rank
        }
        scale = self._loss_scale()
        if scale is not None:
            record.update(loss_scale=scale, skipped_steps=s.skipped_steps)
        self.metrics.write(record)
        return record

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        if not self.peak_flops or not tokens_per_s == tokens_per_s:  # unknown peak, or NaN rate
            return None
        return tokens_per_s * self.flops_per_token / self.peak_flops

    def _loss_scale(self) -> Optional[float]:
        """fp16's dynamic loss scale (Accelerate's GradScaler or DeepSpeed's), else None."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return float(scaler.get_scale())
        engine_optimizer = getattr(self.model, "optimizer", None)
        scale = getattr(engine_optimizer, "cur_scale", None) if self.accelerator.mixed_precision == "fp16" else None
        return float(scale) if scale is not None else None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """eval_loss, perplexity and next-token accuracy over the validation blocks,
        gathered across ranks (gather_for_metrics drops the padding duplicates)."""
        acc = self.accelerator
        self.model.eval()
        losses, correct = [], []
        started = time.perf_counter()
        for batch in self.eval_loader:
            logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
            if logits.dtype != torch.float32:  # bf16/fp16 logits: reduce in fp32
                logits = logits.float()
            labels = batch["labels"][:, 1:]
            # Cross-entropy as logsumexp - picked logit: one pass fewer over the
            # vocabulary than F.cross_entropy on the reshaped copy.
            token_loss = torch.logsumexp(logits, dim=-1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            per_sample_loss = token_loss.mean(dim=1)  # every block has the same length
            per_sample_acc = (logits.argmax(-1) == labels).float().mean(dim=1)
            losses.append(acc.gather_for_metrics(per_sample_loss))
            correct.append(acc.gather_for_metrics(per_sample_acc))
        self.model.train()
        if not losses:
            return {}
        eval_loss = torch.cat(losses).mean().item()
        samples = sum(len(x) for x in losses)
        runtime = time.perf_counter() - started
        return {
            "eval_loss": eval_loss,
            "perplexity": perplexity(eval_loss),
            "eval_accuracy": torch.cat(correct).mean().item(),
            "eval_samples": samples,
            "eval_runtime": round(runtime, 3),
            "eval_samples_per_second": round(samples / runtime, 3) if runtime > 0 else None,
        }

    def _evaluate_and_log(self, progress: Optional[Progress]) -> dict[str, float]:
        results = self.evaluate()
        if results:
            self.state.last_eval = results
            self.metrics.write({"step": self.state.step, **{k: results[k] for k in ("eval_loss", "perplexity", "eval_accuracy")}})
            line = f"step {self.state.step}: eval_loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.2f}"
            if progress is not None:
                progress.write(line)
            else:
                log.info(line)
        return results

    def _train_results(self, runtime: float) -> dict[str, Any]:
        s, plan = self.state, self.plan
        if s.loss_count:  # steps since the last log
            self._close_loss_window(s.step - s.total_loss_steps)
        train_loss = s.total_loss / s.total_loss_steps if s.total_loss_steps else math.nan
        samples = s.step * plan.global_batch_size
        return {
            "epoch": round(s.step / max(plan.steps_per_epoch, 1), 4),
            "train_loss": train_loss,
            "train_runtime": round(runtime, 3),
            "train_samples": samples,
            "train_steps": s.step,
            "train_tokens": samples * plan.block_size,
            "train_samples_per_second": round(samples / runtime, 3),
            "train_steps_per_second": round(s.step / runtime, 3),
            "train_tokens_per_second": round(samples * plan.block_size / runtime, 1),
            "train_mfu": self.mfu(samples * plan.block_size / runtime),
            "first_step_time": s.first_step_time,
        }
