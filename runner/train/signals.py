"""SIGTERM / SIGINT: finish the current step, checkpoint, exit non-zero.

Preemption on clusters is a SIGTERM followed, some seconds later, by SIGKILL. Each
rank only notes the signal; at optimizer-step boundaries all ranks agree to stop
together at the same step.

The agreement must not make the host wait for the GPU every step (an all-reduce of a
CUDA tensor read back with .item() does). So it runs on the host: a gloo group of its
own, CPU tensors, started without waiting at one boundary and read at the next, by
which time the other ranks have long sent their part. Every rank reads the same sum
at the same boundary, so all stop at the same step, one step after the signal.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Optional

import torch
from accelerate import Accelerator

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

# A signal a local sweep's launcher took outside any job's training loop (between jobs,
# or while a job loads its data): the next training loop stops at its first step, and
# the sweep starts no further job (runner/sweep/resume.py).
_held: Optional[int] = None
_holding = False


def hold_signals() -> None:
    """Note SIGTERM / SIGINT instead of dying mid-setup; a second Ctrl-C stops at once."""
    global _holding
    _holding = True

    def note(signum: int, frame: Optional[FrameType]) -> None:
        global _held
        if _held is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _held = signum

    for sig in EXIT_CODES:
        signal.signal(sig, note)


def held_signal() -> Optional[int]:
    return _held


def hold_again() -> None:
    """Before each sweep job: a multi-process job's torch elastic agent replaced the hold
    with handlers that raise, and does not put it back."""
    if _holding:
        hold_signals()


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None  # gloo process group for the agreement (multi-process only)
        self._pending: Optional[tuple[Any, Any]] = None  # (async all-reduce, its CPU tensor)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def install(self) -> "StopRequest":
        self.signum = self.signum or held_signal()  # taken before this loop began
        for sig in EXIT_CODES:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. under some test runners)
                pass
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, accelerator: "Accelerator") -> Optional[int]:
        """The signal to stop for, if any rank had received one by the previous boundary
        (the same answer on every rank)."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch.distributed as dist

        if self._group is None:
            # Collective: every rank reaches its first boundary. A group of its own, also
            # on CPU runs, so the pending reduce never sits between DDP's own collectives.
            self._group = dist.new_group(backend="gloo")
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # host-side only: gloo, CPU tensor
            agreed = int(flag.item())
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, group=self._group, async_op=True), flag)
        if agreed and self.signum is None:
            self.signum = signal.SIGTERM
        return self.signum if agreed else None


class Stopped(Exception):
    """Training stopped on a signal after writing a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint}")
