"""The generic training loop: accumulate, backward, clip, step, log, evaluate, checkpoint.

Objects come in already built and prepared (see runner/train/worker.py); this module
only runs them. `fit` reads top to bottom; the detail lives in `train_step`,
`evaluate` and `_log_step`.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from runner.components.chunked_loss import ChunkedLoss
from runner.components.compile import NO_COMPILE, compile_stats
from runner.components.labels import model_inputs, token_losses
from runner.components.loss_parts import CrossEntropyTap, weighted, window_counts
from runner.config.spec import PrecisionSpec
from runner.distributed.process_group import all_ranks_agree
from runner.distributed.strategy import Strategy
from runner.report.metrics import MetricsWriter, Progress, current_memory_mb, perplexity, window_peak_memory_mb
from runner.train.checkpoint import checkpoint_dir, latest_checkpoint, load_rank_state, save_checkpoint
from runner.train.ledger import Ledger, launch_time, resumed, write_snapshot
from runner.train.plan import RunPlan
from runner.train.signals import Stopped, StopRequest
from runner.train.verdict import NonFiniteStep, Verdicts

log = logging.getLogger("runner")


def _postfix(record: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows beside its rate and ETA."""
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if record.get("mfu") is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    shown["mem"] = f"{max(record['peak_memory_mb']):,.0f}MB"
    return shown


class NonFiniteLoss(RuntimeError):
    """A NaN or inf loss or gradient norm: the run stops before the optimizer step (under
    fp16: after precision.max_consecutive_skipped_steps overflows in a row)."""


class NoStepInPass(RuntimeError):
    """A whole pass over the training data gave no optimizer step: every further pass
    would give none either, so the loop would spin forever without training."""


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
    total_loss: float = 0.0  # mean-of-steps train loss, like the HF Trainer's train_loss
    total_loss_steps: int = 0
    skipped_steps: int = 0  # fp16 overflows: the step was skipped and the loss scale lowered
    consecutive_skips: int = 0  # skipped steps since the last step taken (precision.max_consecutive_skipped_steps)
    first_step_time: Optional[float] = None  # wall clock (time.time()) when step 1 finished, for benchmarks
    last_eval: dict[str, float] = field(default_factory=dict)
    # Token-weighted (instruction) runs: the tokens trained so far that are not padding,
    # on all ranks (on the device, read at log steps), and how many of them came before
    # this process started; None when a checkpoint did not record them.
    real_tokens: Optional[torch.Tensor] = None
    real_tokens_at_start: Optional[int] = 0


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
        strategy: Strategy,
        max_grad_norm: float,
        log_every: int,
        eval_every: int,
        save_every: int,
        keep_checkpoints: int,
        sampler: Any = None,
        spec_yaml: str = "",
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
        max_consecutive_skipped_steps: int = PrecisionSpec.max_consecutive_skipped_steps,
        stream: bool = False,
        data_record: Optional[dict[str, Any]] = None,
        token_weighted: bool = False,
        chunked_loss: Optional[ChunkedLoss] = None,
        compiled: bool = False,
    ) -> None:
        self.accelerator = accelerator
        self.strategy = strategy  # backward, norm, step, loss scale: the strategy's own
        self.model = model
        self.chunked_loss = chunked_loss  # the training forward's loss over chunks of tokens
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.plan = plan
        # A step's loss is the sum over its trained tokens, on every rank and micro-batch,
        # over their number (_token_weighted_windows): answer tokens of instruction data,
        # and run_clm's blocks too, whose epoch ends in a short step (a short window, and
        # fillers that train nothing: runner/components/epoch_batches.py). A stream's
        # steps are all whole, so it keeps the mean per micro-batch. `token_weighted`:
        # the rates count real tokens, not the rows' capacity (instruction data).
        self.token_weighted = token_weighted
        # Only the cross-entropy is so weighted: what the model adds after it (a mixture of
        # experts' router loss) stays a mean per micro-batch (runner/components/loss_parts.py).
        self.cross_entropy = CrossEntropyTap(accelerator.unwrap_model(model))
        self._logged_real_tokens = 0  # real tokens at the last log line (token-weighted runs)
        self.run_dir = run_dir
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_skipped_steps = max_consecutive_skipped_steps  # fp16 overflows in a row that stop the run
        self.log_every, self.eval_every, self.save_every = log_every, eval_every, save_every
        self.keep_checkpoints = keep_checkpoints
        self.state = LoopState()
        self.metrics = MetricsWriter(
            run_dir / "metrics.jsonl",
            accelerator.is_main_process,
            # Trackers start after a resume is known (worker.tracker_kwargs); none: log() does nothing.
            tracker_log=lambda values, step: accelerator.log(values, step=step),
        )
        self.grad_norm: Optional[torch.Tensor] = None
        # Non-finite verdicts handed to fused AdamW, not yet read on the host (runner/train/verdict.py).
        self.verdicts = Verdicts(asynchronous=accelerator.device.type == "cuda")
        self.sampler = sampler
        self.spec_yaml = spec_yaml  # saved into each checkpoint, to check a resume against
        self.stop = StopRequest()
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # all devices together
        self.last_checkpoint: Optional[Path] = None
        self.step_lr = float("nan")  # the rate the last optimizer step trained at (metrics' lr)
        # The final evaluation a resume at the last step found recorded (worker.py): reused, not run again
        self.final_eval: Optional[dict[str, Any]] = None
        # data.streaming=true: train_loader is this rank's own stateful loader (not prepared
        # by Accelerate), its position saved with each checkpoint (see _stream_batches).
        self.stream = stream
        # Which data the position indexes (a stream's files, the cached blocks' key): a resume checks it
        self.data_record = data_record or {}
        self.data_wait = 0.0  # seconds spent waiting for training batches, after the first
        self.first_batch_wait: Optional[float] = None  # opening the data (a stream reads its first window)
        # Where the launch's wall time goes (runner/train/ledger.py). `_loop_started` and
        # `_loop_elsewhere` (the loop's seconds in the other parts) give its steps' share.
        self.ledger = resumed(run_dir, launch_time(), 0)  # a restart before any checkpoint carries it on
        self._loop_started: Optional[float] = None
        self._loop_elsewhere = 0.0
        self._first_batch_part = "startup"
        # model.compile: what compiling cost this run (torch counts per process: an earlier
        # run of an in-process sweep is left out), moved out of the part it happened in.
        self.compiled = compiled
        self._compile_start = self._compile_seen = compile_stats() if compiled else NO_COMPILE

    # ------------------------------------------------------------------ loop
    def fit(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Train to plan.total_steps, evaluate at the end; returns (train, eval) results."""
        plan, s = self.plan, self.state
        progress = Progress(plan.total_steps, self.accelerator.is_main_process, initial=s.step)
        self._first_batch_part = self.ledger.begin(time.time(), s.step)
        if self.accelerator.is_main_process:  # a restart before the next checkpoint starts from here too
            write_snapshot(self.run_dir, self.ledger, s.step)
        started = window_start = self._loop_started = time.perf_counter()
        window_steps = 0
        self._logged_real_tokens = self._real_tokens()
        self.model.train()
        self.stop.install()
        empty_passes = 0  # passes in a row that gave no step (a resumed one may start at its end)
        try:
            while s.step < plan.total_steps:
                pass_start = s.step
                batches = self._timed(self._epoch_batches())
                for batch in batches if self.stream else self._token_weighted_windows(batches):
                    s.samples_in_epoch += self.samples_per_batch
                    if not self.train_step(batch):
                        continue
                    window_steps += 1
                    if (self.log_every and s.step % self.log_every == 0) or (self.eval_every and s.step % self.eval_every == 0):
                        self._read_verdict()  # before any figure of this step is reported
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
                    s.epoch, s.samples_in_epoch = s.epoch + 1, 0
                    empty_passes = empty_passes + 1 if s.step == pass_start else 0
                    if empty_passes == 2:  # the second from a pass's very start: the data is too short
                        raise NoStepInPass(
                            f"a pass over the training data gives no optimizer step on some rank (one step is "
                            f"{plan.per_device_batch_size} blocks x {plan.grad_accum_steps} accumulation a rank). Give "
                            "more data, raise data.max_train_samples, or lower train.per_device_batch_size.")
                    self._stop_if_signalled()  # also between passes: a pass may hold no step at all
        finally:
            self.stop.restore()
            progress.close()
        runtime = time.perf_counter() - started
        self.ledger = self._ledger_now()  # the loop is over: its steps' time is final
        self._loop_started = None
        self._read_verdict()
        eval_results = self.final_eval if self.final_eval is not None else self._evaluate_and_log(None)
        return self._train_results(runtime), eval_results

    def _ledger_now(self) -> Ledger:
        """The ledger with the loop's steps so far: its time less what went to the other parts."""
        ledger = self.ledger.copy()
        if self._loop_started is not None:
            ledger.add("steps", time.perf_counter() - self._loop_started - self._loop_elsewhere)
        return ledger

    def _elsewhere(self, part: str, seconds: float) -> None:
        """Loop time spent in `part`, not in steps."""
        if part == "checkpoint_saves":
            self.ledger.add_save(seconds)
        else:
            self.ledger.add(part, seconds)
        if self._loop_started is not None:
            self._loop_elsewhere += seconds

    def _count_compile(self) -> float:
        """Compile seconds since the last count, moved into the ledger's `compile` part
        (out of the loop's steps; a caller that timed them itself subtracts the return)."""
        if not self.compiled:
            return 0.0
        now = compile_stats()
        seconds, self._compile_seen = max(now.seconds - self._compile_seen.seconds, 0.0), now
        if seconds:
            self._elsewhere("compile", seconds)
        return seconds

    def compile_results(self) -> dict[str, Any]:
        """all_results.json's account of model.compile: its time apart from the steps', the
        frames compiled, recompilations (a guard failed: another shape, grad mode) and
        graph breaks."""
        if not self.compiled:
            return {}
        run = compile_stats().minus(self._compile_start)
        return {"compile_seconds": round(run.seconds, 3), "compile_frames": run.frames,
                "recompilations": run.recompilations, "graph_breaks": run.graph_breaks}

    def _timed(self, batches: Any) -> Any:
        """The batches, with the time spent waiting for each added to data_wait."""
        it = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                waited = time.perf_counter() - started
                if self.first_batch_wait is None:
                    self.first_batch_wait = waited
                    self._elsewhere(self._first_batch_part, waited)
                else:
                    self.data_wait += waited
                    self._elsewhere("data_wait", waited)
            yield batch

    def _token_weighted_windows(self, batches: Any) -> Any:
        """The batches, one optimizer step's at a time, each carrying the step's number of
        trained tokens on all ranks (`num_items_in_batch`, one all-reduce a step), read
        before the step's first micro-batch runs. A step's window is what is left of its
        accumulation (Accelerate's micro-batch counter), cut short where the data ends."""
        it = iter(batches)
        accum = self.plan.grad_accum_steps
        while True:
            # Never read past the epoch's last batch: that would end Accelerate's loader
            # (and its end-of-data step) before the window's micro-batches run.
            left = len(self.train_loader) - self.batches_done_in_epoch()
            window = list(islice(it, min(accum - self.accelerator.step % accum, left)))
            if not window:
                return
            counts = window_counts(window, self.accelerator.device, self.accelerator.num_processes > 1)
            s = self.state
            s.real_tokens = counts.real_tokens if s.real_tokens is None else s.real_tokens + counts.real_tokens
            # Accelerate's loader marks the end of data when it hands out the last batch,
            # here already read; the window's earlier micro-batches must not see it, or
            # the step would be taken after the first of them.
            loader = self.accelerator.gradient_state.active_dataloader
            ended = bool(loader is not None and loader.end_of_dataloader)
            for index, batch in enumerate(window):
                if loader is not None:
                    loader.end_of_dataloader = ended and index == len(window) - 1
                yield {**batch, "num_items_in_batch": counts.trained_tokens, "window_micro_batches": len(window),
                       "added_share": counts.added_shares[index]}

    def _epoch_batches(self) -> Any:
        """This epoch's batches from the current data position (exact after a resume)."""
        if self.stream:
            return self._stream_batches()
        loader = self.train_loader
        done = self.batches_done_in_epoch()
        if done:
            loader = self.accelerator.skip_first_batches(self.train_loader, done)
        # Accelerate's loaders set their sampler's epoch from their own pass count at
        # each __iter__; a resumed (or skipping) loader must be told the real epoch.
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.state.epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(self.state.epoch)
        return loader

    def _stream_batches(self) -> Any:
        """A stream's batches, one optimizer step's micro-batches at a time.

        The ranks' shares of a stream end at different points, and an unprepared loader
        gives Accelerate no end-of-data signal for a short accumulation: so a step is
        read whole before it is trained, and the pass (epoch) ends for every rank when
        any rank cannot read a whole step (its remainder is dropped, as drop_last does)."""
        self.sampler.set_epoch(self.state.epoch)  # the shuffle windows' seed; a restored position carries its own
        batches = iter(self.train_loader)
        device = self.accelerator.device
        while True:
            step = list(islice(batches, self.plan.grad_accum_steps))
            if not all_ranks_agree(len(step) == self.plan.grad_accum_steps):
                return
            for batch in step:
                yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    @property
    def samples_per_batch(self) -> int:
        """Samples of the global order one micro-batch round takes, over all ranks."""
        return self.plan.world_size * self.plan.per_device_batch_size

    def batches_done_in_epoch(self) -> int:
        """This rank's micro-batches already consumed in the epoch, from the sample position."""
        if self.state.samples_in_epoch >= self.plan.train_blocks:
            return len(self.train_loader)  # the epoch is over; the loop moves to the next
        return self.state.samples_in_epoch // self.samples_per_batch

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
        started = time.perf_counter()
        path = self._save_checkpoint()
        self._elsewhere("checkpoint_saves", time.perf_counter() - started)
        if self.accelerator.is_main_process:  # a restart in this launch carries the ledger on from here
            write_snapshot(self.run_dir, self._ledger_now(), self.state.step)
        return path

    def _save_checkpoint(self) -> Path:
        self._read_verdict()  # never save weights a non-finite step touched
        s, plan = self.state, self.plan
        # Each rank's own running loss sum, so a resume inside a logging window closes
        # that window with the very same numbers (a mean over ranks would round).
        pending = torch.zeros(1, device=self.accelerator.device) if s.loss_sum is None else s.loss_sum.reshape(1)
        pending_sums = [float(v) for v in self.accelerator.gather(pending.float()).cpu()]
        meta = {
            "epoch": s.epoch,
            "samples_in_epoch": s.samples_in_epoch,
            "world_size": self.accelerator.num_processes,
            "per_device_batch_size": plan.per_device_batch_size,
            "grad_accum_steps": plan.grad_accum_steps,
            "total_steps": plan.total_steps,  # a resume=auto at or past it finds the run finished
            "steps_per_epoch": plan.steps_per_epoch,
            "total_loss": s.total_loss,
            "total_loss_steps": s.total_loss_steps,
            "pending_loss_sums": pending_sums,
            "pending_loss_count": s.loss_count,
            "skipped_steps": s.skipped_steps,
        }
        if self.token_weighted:
            meta["real_tokens"] = self._real_tokens()
        meta.update(self.data_record)
        rank_state = {"data": self.train_loader.state_dict()} if self.stream else None
        self.last_checkpoint = save_checkpoint(
            self.accelerator, self.run_dir, s.step, self.keep_checkpoints, meta, spec_yaml=self.spec_yaml,
            rank_state=rank_state,
        )
        return self.last_checkpoint

    def restore(self, meta: dict[str, Any], checkpoint: Optional[Path] = None) -> None:
        """Continue from a checkpoint's loop state (model and optimizer are already loaded)."""
        s, plan = self.state, self.plan
        if self.stream:  # the stream's own position, through its loader's load_state_dict
            assert checkpoint is not None, "a stream resumes from its checkpoint's per-rank data state"
            self.train_loader.load_state_dict(load_rank_state(checkpoint, self.accelerator.process_index)["data"])
        s.step, s.epoch = int(meta["step"]), int(meta["epoch"])
        s.start_step = s.step
        if checkpoint is not None and checkpoint.resolve() == self._checkpoint_path().resolve():
            self.last_checkpoint = self._checkpoint_path()  # this folder's own: not saved again at the end
        self.ledger = resumed(self.run_dir, self.ledger.launch, s.step)
        if "samples_in_epoch" in meta:
            s.samples_in_epoch = int(meta["samples_in_epoch"])
        else:  # checkpoints before the position was kept in samples: same layout only
            s.samples_in_epoch = int(meta["batches_in_epoch"]) * self.samples_per_batch
        s.total_loss, s.total_loss_steps = float(meta["total_loss"]), int(meta["total_loss_steps"])
        # load_state restored Accelerate's micro-batch counter as the old layout left it;
        # it decides which micro-batch ends an accumulation. A checkpoint sits at a step
        # boundary, so in this layout the count is this rank's batches into the epoch
        # (a whole number of accumulations: resume.layout_change_problems sees to it).
        done = 0 if self.stream else self.batches_done_in_epoch()
        self.accelerator.step = done if self.stream or done < len(self.train_loader) else 0
        s.skipped_steps = int(meta.get("skipped_steps", 0))
        if self.token_weighted:  # a checkpoint from before real tokens were counted: rates only
            before = meta.get("real_tokens")
            s.real_tokens_at_start = None if before is None else int(before)
            s.real_tokens = torch.tensor(s.real_tokens_at_start or 0, dtype=torch.int64, device=self.accelerator.device)
        count = int(meta.get("pending_loss_count", 0))
        if count:
            sums = meta.get("pending_loss_sums") or [float(meta["pending_loss_sum"])]
            same_layout = (
                len(sums) == plan.world_size
                and int(meta.get("grad_accum_steps", plan.grad_accum_steps)) == plan.grad_accum_steps
            )
            if same_layout:  # this rank's own sum: the window closes bit-exactly
                s.loss_count = count
                s.loss_sum = torch.tensor(sums[self.accelerator.process_index], device=self.accelerator.device)
            else:  # another layout: the window's mean micro-batch loss, over this layout's count
                old_accum = int(meta.get("grad_accum_steps", 1))
                s.loss_count = count // old_accum * plan.grad_accum_steps
                mean = sum(sums) / len(sums) / count
                s.loss_sum = torch.tensor(mean * s.loss_count, device=self.accelerator.device)

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: dict[str, torch.Tensor]) -> bool:
        """One micro-batch; returns True when it completed an optimizer step (taken or,
        under fp16, skipped on an overflow)."""
        acc, s = self.accelerator, self.state
        with acc.accumulate(self.model):
            items, micro = batch.pop("num_items_in_batch", None), batch.pop("window_micro_batches", None)
            added_share = batch.pop("added_share", None)
            if items is None:
                with self._loss_over_chunks(batch):
                    loss = logged = self.model(**self._inputs(batch, labels=True)).loss
            else:
                # transformers' loss: this micro-batch's token losses summed, over the step's
                # trained tokens on all ranks. Backward averages over ranks (DDP, ZeRO,
                # FSDP) and divides by the accumulation (Accelerate, DeepSpeed): undone here,
                # so the step's gradient is that of the sum over all its tokens / their number.
                # The log averages over ranks and the window's micro-batches. What the model
                # adds (a router loss) is a mean per micro-batch: averaged over the step's
                # micro-batches that are not all fillers, on all ranks (`added_share`).
                with self._loss_over_chunks(batch):
                    share = self.model(**self._inputs(batch, labels=True), num_items_in_batch=items).loss
                cross_entropy, accum = self.cross_entropy.take(), self.plan.grad_accum_steps
                undo = acc.num_processes * accum  # what backward divides by: ranks x accumulation
                loss = weighted(share, cross_entropy, undo, undo * added_share)
                logged = weighted(share, cross_entropy, acc.num_processes * micro, acc.num_processes * micro * added_share)
            self.strategy.backward(acc, loss)  # under DeepSpeed too, nothing is stepped yet
            self._count_compile()
            if acc.sync_gradients:
                self._check_finite(loss)
                self.step_lr = self.scheduler.get_last_lr()[0]  # logged as this step's, as transformers' Trainer does
                if self._optimizer_step():
                    # Stepped here, once per optimizer step, never by Accelerate per process.
                    self.scheduler.step()
                    s.consecutive_skips = 0
                else:
                    self._count_skip()
                self.optimizer.zero_grad(set_to_none=True)
        detached = logged.detach().float()
        s.loss_sum = detached if s.loss_sum is None else s.loss_sum + detached
        s.loss_count += 1
        if not acc.sync_gradients:
            return False
        s.step += 1
        if s.first_step_time is None:
            s.first_step_time = time.time()
        return True

    def _optimizer_step(self) -> bool:
        """Step the optimizer; False when the step was skipped (an fp16 overflow)."""
        try:
            return self.strategy.optimizer_step(self.accelerator, self.optimizer)
        finally:
            self.verdicts.after_step()  # a found_inf flag belongs to this one step

    def _count_skip(self) -> None:
        s = self.state
        s.skipped_steps += 1
        s.consecutive_skips += 1
        if s.consecutive_skips >= self.max_consecutive_skipped_steps:
            raise NonFiniteLoss(
                f"{s.consecutive_skips} optimizer steps in a row were skipped on fp16 overflows (steps "
                f"{s.step + 2 - s.consecutive_skips}-{s.step + 1}, loss scale now {self._loss_scale()}): the gradients "
                f"stay non-finite at any scale; {self._last_good()}. Lower optim.lr, raise schedule.warmup_steps, use "
                "precision=bf16, or raise precision.max_consecutive_skipped_steps."
            )

    def _last_good(self) -> str:
        last = self.last_checkpoint or latest_checkpoint(self.run_dir)
        return f"the last good checkpoint is {last}" if last else "there is no checkpoint yet"

    def _inputs(self, batch: dict[str, Any], labels: bool = False) -> dict[str, Any]:
        """The forward's arguments; no KV cache when the layers are compiled (model_inputs)."""
        return model_inputs(batch, labels=labels, cache=not self.compiled)

    def _loss_over_chunks(self, batch: dict[str, Any]) -> Any:
        """The next forward's head and loss chunked (runner/components/chunked_loss.py),
        when installed."""
        return nullcontext() if self.chunked_loss is None else self.chunked_loss.labels(batch["labels"])

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Stop before a NaN/inf loss or global gradient norm reaches the weights.

        The norm is computed (and clipped when optim.max_grad_norm > 0) even with clipping
        off; it is global, so every rank reaches the same verdict. Under fp16 a non-finite
        gradient is an overflow: the loss scaler skips the step (counted in
        _optimizer_step), which is expected, not fatal.

        Reading the verdict on the host would make a GPU wait every step. An optimizer
        that honours `found_inf` (torch's fused AdamW) is handed it on the device instead
        and skips the update itself; the host reads it when the device is done with it
        (runner/train/verdict.py). Other optimizers (foreach AdamW, DeepSpeed's), and
        parameters on another device than the loss, are checked on the host before
        their step.
        """
        self._raise_if_bad(self.verdicts.poll())  # earlier steps' verdicts, only those ready
        self.grad_norm = self.strategy.grad_norm(self.accelerator, self.model, self.max_grad_norm)
        if self.accelerator.mixed_precision == "fp16":
            return
        checks = torch.cat([loss.detach().float().reshape(1), torch.as_tensor(self.grad_norm).float().reshape(1).to(loss.device)])
        inner = self._found_inf_optimizer(loss.device)
        if inner is None:
            self._raise_if_bad(self.verdicts.check_now(self.state.step + 1, checks))
        else:
            self.verdicts.hand_to(inner, self.state.step + 1, checks)

    def _found_inf_optimizer(self, device: torch.device) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer if it skips its own update on a `found_inf` flag on `device`;
        None under DeepSpeed (its engine steps its own) or with parameters elsewhere."""
        return self.strategy.found_inf_optimizer(self.optimizer, device)

    def _read_verdict(self) -> None:
        """Raise if any step so far had a non-finite loss or gradient norm (waits for the device)."""
        self._raise_if_bad(self.verdicts.drain())

    def _raise_if_bad(self, bad: Optional[NonFiniteStep]) -> None:
        if bad is None:
            return
        skipped = "its update was skipped and the run stopped" if bad.skipped_on_device else "stopped before the optimizer step"
        raise NonFiniteLoss(
            f"non-finite loss or gradient norm at step {bad.step} (loss {bad.loss}, grad norm {bad.grad_norm}); "
            f"{skipped}; {self._last_good()}. Lower optim.lr, raise schedule.warmup_steps, or use precision=fp32."
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
        in the per-step finite check). `window_steps` counts the steps this process ran
        in the window (for the rates); after a resume inside a window the loss window
        also holds the steps from before the checkpoint."""
        s, plan = self.state, self.plan
        mean = self._close_loss_window(s.step - s.total_loss_steps)
        rate = window_steps / elapsed if elapsed > 0 else float("nan")
        if self.token_weighted:  # padding is not counted
            trained = self._real_tokens()
            tokens_per_s = (trained - self._logged_real_tokens) / elapsed if elapsed > 0 else float("nan")
            self._logged_real_tokens = trained
        else:
            tokens_per_s = rate * plan.tokens_per_step
        device = self.accelerator.device
        memory = self.accelerator.gather(torch.tensor([[window_peak_memory_mb(device), current_memory_mb(device)]], device=device))
        record = {
            "step": s.step,
            # a stream's passes so far (its length is unknown until read through)
            "epoch": s.epoch if self.stream else round(s.epoch + min(s.samples_in_epoch / max(plan.train_blocks, 1), 1.0), 4),
            "loss": mean,
            "lr": self.step_lr,
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

    def _real_tokens(self) -> int:
        """Tokens trained so far that are not padding (token-weighted runs; reads the device)."""
        return 0 if self.state.real_tokens is None else int(self.state.real_tokens)

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        if not self.peak_flops or not tokens_per_s == tokens_per_s:  # unknown peak, or NaN rate
            return None
        return tokens_per_s * self.flops_per_token / self.peak_flops

    def _loss_scale(self) -> Optional[float]:
        """fp16's dynamic loss scale (Accelerate's GradScaler or DeepSpeed's), else None."""
        return self.strategy.loss_scale(self.accelerator, self.model)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """eval_loss, perplexity and next-token accuracy over the validation rows, gathered
        across ranks (gather_for_metrics drops the padding duplicates). Token-weighted: the
        sum of every trained token's loss over their number (labels -100 excluded), so
        neither padding nor packing changes the figure; for run_clm's equal blocks it is
        the mean of the blocks' means."""
        acc = self.accelerator
        self.model.eval()
        sums, counts, correct = [], [], []
        started = time.perf_counter()
        for batch in self.eval_loader:
            token_loss, trained, right = self._token_scores(batch)
            sums.append(acc.gather_for_metrics(token_loss.sum(dim=1)))
            counts.append(acc.gather_for_metrics(trained.sum(dim=1)))
            correct.append(acc.gather_for_metrics(right.sum(dim=1)))
        self.strategy.after_evaluation(self.model)  # ZeRO-3: nothing left in flight from the last batch
        self.model.train()
        if not sums:
            return {}
        tokens = torch.cat(counts).sum().clamp(min=1)
        eval_loss = (torch.cat(sums).sum() / tokens).item()
        samples = sum(len(x) for x in sums)
        runtime = time.perf_counter() - started
        return {
            "eval_loss": eval_loss,
            "perplexity": perplexity(eval_loss),
            "eval_accuracy": (torch.cat(correct).sum() / tokens).item(),
            "eval_samples": samples,
            "eval_runtime": round(runtime, 3),
            "eval_samples_per_second": round(samples / runtime, 3) if runtime > 0 else None,
        }

    def _token_scores(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-token losses, trained mask, correct predictions) of one evaluation batch,
        aligned with labels[:, 1:]. Through the chunked head when installed: the whole
        logits in fp32 would be the largest thing evaluation holds (GPT-2's vocabulary:
        200 KB a token), larger than the training step's planned peak."""
        inputs = model_inputs(batch, cache=not self.compiled)
        if self.chunked_loss is not None:
            scores = self.chunked_loss.scores(self.model, inputs, batch["labels"])
            return scores.losses, scores.trained, scores.correct
        logits = self.model(**inputs).logits
        token_loss, trained = token_losses(logits, batch["labels"])
        predicted = logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]
        return token_loss, trained, predicted & trained

    def _evaluate_and_log(self, progress: Optional[Progress]) -> dict[str, float]:
        started = time.perf_counter()
        results = self.evaluate()
        compiling = self._count_compile()  # its first batch compiles the no-grad graphs
        self._elsewhere("evaluation", time.perf_counter() - started - compiling)
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
        # Rates count only the steps this process ran, over the time it ran them: after
        # a resume, the steps before the checkpoint took time this process never saw.
        steps_run = s.step - s.start_step
        first = self.first_batch_wait or 0.0
        samples_run = steps_run * plan.global_batch_size
        tokens_run = samples_run * plan.block_size
        tokens: Optional[int] = samples * plan.block_size
        if self.token_weighted:  # real tokens, not the rows' capacity
            tokens_run = self._real_tokens() - (s.real_tokens_at_start or 0)
            tokens = None if s.real_tokens_at_start is None else self._real_tokens()
        return {
            "epoch": s.epoch if self.stream else round(s.step / max(plan.steps_per_epoch, 1), 4),
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
            "data_wait_seconds": round(self.data_wait, 3),
            "data_wait_fraction": round(self.data_wait / (runtime - first), 4) if runtime - first > 0 else None,
            "first_batch_seconds": round(first, 3),
        }
