"""The loop's training batches: from the data position, an optimizer step's window at a time.

Mechanics of the loop, not of the loss: Accelerate's micro-batch counter and its
end-of-data signal, the position in samples (exact after a resume in another layout),
a stream's whole steps. What a window's micro-batches need from the whole step (the
objective's counts, on all ranks) is asked of the objective as each window is read.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Iterator

from runner.components.objectives.base import Objective
from runner.distributed.process_group import all_ranks_agree
from runner.train.loop_state import LoopState
from runner.train.parts import TrainData
from runner.train.plan import RunPlan


class Batches:
    def __init__(self, accelerator: Any, data: TrainData, plan: RunPlan, state: LoopState,
                 objective: Objective) -> None:
        self.accelerator, self.data, self.plan, self.state, self.objective = accelerator, data, plan, state, objective

    @property
    def samples_per_batch(self) -> int:
        """Samples of the global order one micro-batch round takes, over all ranks."""
        return self.plan.world_size * self.plan.per_device_batch_size

    def done_in_epoch(self) -> int:
        """This rank's micro-batches already consumed in the epoch, from the sample position."""
        if self.state.samples_in_epoch >= self.plan.train_blocks:
            return len(self.data.train_loader)  # the epoch is over; the loop moves to the next
        return self.state.samples_in_epoch // self.samples_per_batch

    def epoch(self) -> Any:
        """This epoch's batches from the current data position (exact after a resume)."""
        if self.data.stream:
            return self._stream()
        loader = self.data.train_loader
        done = self.done_in_epoch()
        if done:
            loader = self.accelerator.skip_first_batches(self.data.train_loader, done)
        # Accelerate's loaders set their sampler's epoch from their own pass count at
        # each __iter__; a resumed (or skipping) loader must be told the real epoch.
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.state.epoch)
        if self.data.sampler is not None:
            self.data.sampler.set_epoch(self.state.epoch)
        return loader

    def windows(self, batches: Any) -> Iterator[dict[str, Any]]:
        """The batches, one optimizer step's at a time, read before the step's first
        micro-batch runs and handed to the objective (`open_window`: the step's counts on
        all ranks, one all-reduce a step). A step's window is what is left of its
        accumulation (Accelerate's micro-batch counter), cut short where the data ends."""
        it = iter(batches)
        accum = self.plan.grad_accum_steps
        while True:
            # Never read past the epoch's last batch: that would end Accelerate's loader
            # (and its end-of-data step) before the window's micro-batches run.
            left = len(self.data.train_loader) - self.done_in_epoch()
            window = list(islice(it, min(accum - self.accelerator.step % accum, left)))
            if not window:
                return
            opened = self.objective.open_window(window, self.accelerator.device, self.accelerator.num_processes > 1)
            s = self.state
            s.real_tokens = opened.real_tokens if s.real_tokens is None else s.real_tokens + opened.real_tokens
            # Accelerate's loader marks the end of data when it hands out the last batch,
            # here already read; the window's earlier micro-batches must not see it, or
            # the step would be taken after the first of them.
            loader = self.accelerator.gradient_state.active_dataloader
            ended = bool(loader is not None and loader.end_of_dataloader)
            for index, batch in enumerate(opened.batches):
                if loader is not None:
                    loader.end_of_dataloader = ended and index == len(opened.batches) - 1
                yield batch

    def _stream(self) -> Iterator[dict[str, Any]]:
        """A stream's batches, one optimizer step's micro-batches at a time.

        The ranks' shares of a stream end at different points, and an unprepared loader
        gives Accelerate no end-of-data signal for a short accumulation: so a step is
        read whole before it is trained, and the pass (epoch) ends for every rank when
        any rank cannot read a whole step (its remainder is dropped, as drop_last does)."""
        self.data.sampler.set_epoch(self.state.epoch)  # the shuffle windows' seed; a restored position carries its own
        batches = iter(self.data.train_loader)
        device = self.accelerator.device
        while True:
            step = list(islice(batches, self.plan.grad_accum_steps))
            if not all_ranks_agree(len(step) == self.plan.grad_accum_steps):
                return
            for batch in step:
                yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
