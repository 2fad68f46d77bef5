"""The generic training loop: accumulate, backward, clip, step, log, evaluate, checkpoint.

Objects come in already built and prepared (see runner/train/worker.py); this module
only runs them. `fit` reads top to bottom; the detail lives in `train_step`,
`evaluate` and `save_checkpoint`. What a micro-batch's loss is, and what evaluation
reports, is the objective's (runner/components/objectives/base.py): the loop backwards,
steps, logs and gathers what it is given. The batches' windows are runner/train/windows.py,
the metrics lines and results runner/train/results.py, the loop's own checkpointed state
runner/train/loop_state.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from runner.components.compile import NO_COMPILE, compile_stats
from runner.components.objectives.base import Objective
from runner.report.metrics import Progress, evaluation_record
from runner.train.checkpoint import (checkpoint_dir, checkpoint_saved, latest_checkpoint, load_rank_state,
                                     save_checkpoint)
from runner.train.ledger import Ledger, resumed, write_snapshot
from runner.train.loop_state import LoopState, add_micro_batch, checkpoint_meta, close_step, restore_loop_state
from runner.train.parts import Engine, LoopSettings, TrainData
from runner.train.plan import RunPlan
from runner.train.results import Reports, postfix
from runner.train.signals import Stopped, StopRequest
from runner.train.verdict import NonFiniteStep, Verdicts
from runner.train.windows import Batches

log = logging.getLogger("runner")


class NonFiniteLoss(RuntimeError):
    """A NaN or inf loss or gradient norm: the run stops before the optimizer step (under
    fp16: after precision.max_consecutive_skipped_steps overflows in a row)."""


class NoStepInPass(RuntimeError):
    """A whole pass over the training data gave no optimizer step: every further pass
    would give none either, so the loop would spin forever without training."""


class Trainer:
    def __init__(self, engine: Engine, data: TrainData, plan: RunPlan, objective: Objective,
                 settings: LoopSettings, ledger: Optional[Ledger] = None) -> None:
        self.engine, self.data, self.plan, self.objective, self.settings = engine, data, plan, objective, settings
        self.accelerator, self.model, self.strategy = engine.accelerator, engine.model, engine.strategy
        self.optimizer, self.scheduler = engine.optimizer, engine.scheduler
        self.train_loader, self.eval_loader, self.stream = data.train_loader, data.eval_loader, data.stream
        self.run_dir = settings.run_dir
        self.state = LoopState()
        self.batches = Batches(self.accelerator, data, plan, self.state, objective)
        self.reports = Reports(self.accelerator, plan, self.state, data, settings)
        self.grad_norm: Optional[torch.Tensor] = None
        # Non-finite verdicts handed to fused AdamW, not yet read on the host (runner/train/verdict.py).
        self.verdicts = Verdicts(asynchronous=self.accelerator.device.type == "cuda")
        self.stop = StopRequest()
        self.last_checkpoint: Optional[Path] = None
        self.step_lr = float("nan")  # the rate the last optimizer step trained at (metrics' lr)
        # The final evaluation a resume at the last step found recorded (worker.py): reused, not run again
        self.final_eval: Optional[dict[str, Any]] = None
        self.data_wait = 0.0  # seconds spent waiting for training batches, after the first
        self.first_batch_wait: Optional[float] = None  # opening the data (a stream reads its first window)
        # Where the launch's wall time goes (runner/train/ledger.py), from the worker.
        self.ledger = ledger if ledger is not None else Ledger(time.time())
        self._first_batch_part = "startup"
        # model.compile: what compiling cost this run (torch counts per process: an earlier
        # run of an in-process sweep is left out), moved out of the part it happened in.
        self.compiled = settings.compiled
        self._compile_start = self._compile_seen = compile_stats() if self.compiled else NO_COMPILE

    # ------------------------------------------------------------------ loop
    def fit(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Train to plan.total_steps, evaluate at the end; returns (train, eval) results."""
        plan, s = self.plan, self.state
        progress = Progress(plan.total_steps, self.accelerator.is_main_process, initial=s.step)
        self._first_batch_part = self.ledger.begin(time.time(), s.step)
        if self.accelerator.is_main_process:  # a restart before the next checkpoint starts from here too
            write_snapshot(self.run_dir, self.ledger, s.step)
        self.ledger.start_loop()  # the ledger's own clock for its parts; the rates read this module's
        started = window_start = time.perf_counter()
        window_steps = 0
        self.reports.logged_real_tokens = s.real_tokens_so_far()
        self.model.train()
        self.stop.install()
        empty_passes = 0  # passes in a row that gave no step (a resumed one may start at its end)
        try:
            while s.step < plan.total_steps:
                pass_start = s.step
                batches = self._timed(self.batches.epoch())
                for batch in batches if self.stream else self.batches.windows(batches):
                    s.samples_in_epoch += self.batches.samples_per_batch
                    stepped = self.train_step(batch)
                    for part, seconds in self.objective.take_timings().items():  # its own parts (generation)
                        self._elsewhere(part, seconds)
                    if not stepped:
                        continue
                    window_steps += 1
                    logs, evaluates = self._due(self.settings.log_every), self._due(self.settings.eval_every)
                    if logs or evaluates:
                        self._read_verdict()  # before any figure of this step is reported
                    if logs:
                        record = self.reports.log_step(window_steps, time.perf_counter() - window_start, self.grad_norm,
                                                       self.step_lr, self._loss_scale())
                        progress.update(0, **postfix(record))
                        window_start, window_steps = time.perf_counter(), 0
                    progress.update(1)
                    if evaluates and s.step < plan.total_steps:
                        self._evaluate_and_log(progress)
                    if self._due(self.settings.save_every):
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
        self.ledger.end_loop()  # its steps' time is final
        self._read_verdict()
        eval_results = self.final_eval if self.final_eval is not None else self._evaluate_and_log(None)
        return self.reports.train_results(runtime, self.data_wait, self.first_batch_wait), eval_results

    def _due(self, every: int) -> bool:
        """This step is one of every N (0: never)."""
        return bool(every) and self.state.step % every == 0

    def _elsewhere(self, part: str, seconds: float) -> None:
        """Loop time spent in `part`, not in steps."""
        if part == "checkpoint_saves":
            self.ledger.add_save(seconds)
        else:
            self.ledger.add(part, seconds)

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
            write_snapshot(self.run_dir, self.ledger, self.state.step)
        checkpoint_saved(path, {"step": self.state.step, "epoch": self.state.epoch})  # a launch engine's account
        return path

    def _save_checkpoint(self) -> Path:
        self._read_verdict()  # never save weights a non-finite step touched
        meta = checkpoint_meta(self.state, self.plan, self.accelerator, self.data.counts_real_tokens)
        meta.update(self.data.record)
        rank_state: Optional[dict[str, Any]] = {"data": self.train_loader.state_dict()} if self.stream else None
        objective_state = self.objective.state_dict()  # the same on every rank: rank 0's file holds it
        if objective_state and self.accelerator.is_main_process:
            rank_state = {**(rank_state or {}), "objective": objective_state}
        self.last_checkpoint = save_checkpoint(
            self.accelerator, self.run_dir, self.state.step, self.settings.keep_checkpoints, meta,
            spec_yaml=self.settings.spec_yaml,
            rank_state=rank_state,
        )
        return self.last_checkpoint

    def restore(self, meta: dict[str, Any], checkpoint: Optional[Path] = None) -> None:
        """Continue from a checkpoint's loop state (model and optimizer are already loaded)."""
        if self.stream:  # the stream's own position, through its loader's load_state_dict
            assert checkpoint is not None, "a stream resumes from its checkpoint's per-rank data state"
            self.train_loader.load_state_dict(load_rank_state(checkpoint, self.accelerator.process_index)["data"])
        if checkpoint is not None and self.objective.state_dict():  # an objective with state: rank 0 saved it
            self.objective.load_state_dict(load_rank_state(checkpoint, 0).get("objective", {}))
        restore_loop_state(self.state, meta, self.plan, self.accelerator, self.data.counts_real_tokens,
                           self.batches.samples_per_batch)
        if checkpoint is not None and checkpoint.resolve() == self._checkpoint_path().resolve():
            self.last_checkpoint = self._checkpoint_path()  # this folder's own: not saved again at the end
        self.ledger = resumed(self.run_dir, self.ledger.launch, self.state.step)
        # load_state restored Accelerate's micro-batch counter as the old layout left it;
        # it decides which micro-batch ends an accumulation. A checkpoint sits at a step
        # boundary, so in this layout the count is this rank's batches into the epoch
        # (a whole number of accumulations: resume.layout_change_problems sees to it).
        done = 0 if self.stream else self.batches.done_in_epoch()
        self.accelerator.step = done if self.stream or done < len(self.train_loader) else 0

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: dict[str, torch.Tensor]) -> bool:
        """One micro-batch; returns True when it completed an optimizer step (taken or,
        under fp16, skipped on an overflow)."""
        acc, s = self.accelerator, self.state
        with acc.accumulate(self.model):
            loss = self.objective.loss(self.model, batch)
            self.strategy.backward(acc, loss.backward)  # under DeepSpeed too, nothing is stepped yet
            self._count_compile()
            if acc.sync_gradients:
                self._check_finite(loss.backward)
                self.step_lr = self.scheduler.get_last_lr()[0]  # logged as this step's, as transformers' Trainer does
                if self._optimizer_step():
                    # Stepped here, once per optimizer step, never by Accelerate per process.
                    self.scheduler.step()
                    s.consecutive_skips = 0
                else:
                    self._count_skip()
                self.optimizer.zero_grad(set_to_none=True)
        add_micro_batch(s, loss.logged.detach().float(), loss.metrics)
        if not acc.sync_gradients:
            return False
        close_step(s)
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
        if s.consecutive_skips >= self.settings.max_consecutive_skipped_steps:
            raise NonFiniteLoss(
                f"{s.consecutive_skips} optimizer steps in a row were skipped on fp16 overflows (steps "
                f"{s.step + 2 - s.consecutive_skips}-{s.step + 1}, loss scale now {self._loss_scale()}): the gradients "
                f"stay non-finite at any scale; {self._last_good()}. Lower optim.lr, raise schedule.warmup_steps, use "
                "precision=bf16, or raise precision.max_consecutive_skipped_steps."
            )

    def _last_good(self) -> str:
        last = self.last_checkpoint or latest_checkpoint(self.run_dir)
        return f"the last good checkpoint is {last}" if last else "there is no checkpoint yet"

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
        self.grad_norm = self.strategy.grad_norm(self.accelerator, self.model, self.settings.max_grad_norm)
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

    def _loss_scale(self) -> Optional[float]:
        """fp16's dynamic loss scale (Accelerate's GradScaler or DeepSpeed's), else None."""
        return self.strategy.loss_scale(self.accelerator, self.model)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The objective's figures over the validation rows, gathered across ranks
        (gather_for_metrics drops the padding duplicates), with their count and time."""
        acc = self.accelerator
        self.model.eval()
        gathered: dict[str, list[torch.Tensor]] = {}
        started = time.perf_counter()
        for batch in self.eval_loader:
            for name, values in self.objective.rows_with_sources(self.model, batch).items():
                gathered.setdefault(name, []).append(acc.gather_for_metrics(values))
        self.strategy.after_evaluation(self.model)  # ZeRO-3: nothing left in flight from the last batch
        self.model.train()
        if not gathered:
            return {}
        rows = {name: torch.cat(values) for name, values in gathered.items()}
        samples = len(next(iter(rows.values())))
        runtime = time.perf_counter() - started
        return {
            **self.objective.figures_by_source(rows, self.data.sources),
            "eval_samples": samples,
            "eval_runtime": round(runtime, 3),
            "eval_samples_per_second": round(samples / runtime, 3) if runtime > 0 else None,
        }

    def _evaluate_and_log(self, progress: Optional[Progress]) -> dict[str, float]:
        started = time.perf_counter()
        results = self.evaluate()
        compiling = self._count_compile()  # its first batch compiles the no-grad graphs
        self._elsewhere("evaluation", time.perf_counter() - started - compiling)
        if results:
            self.state.last_eval = results
            self.reports.metrics.write({"step": self.state.step, **evaluation_record(results, self.objective.figures)})
            line = f"step {self.state.step}: {self.objective.describe(results)}"
            if progress is not None:
                progress.write(line)
            else:
                log.info(line)
        return results
