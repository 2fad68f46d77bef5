"""SIGTERM / SIGINT: finish the current step, checkpoint, exit non-zero.

Preemption on clusters is a SIGTERM followed, some seconds later, by SIGKILL. Each
rank only notes the signal; at the next optimizer-step boundary all ranks agree
(one tiny all-reduce) to stop together at the same step.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from accelerate import Accelerator

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def install(self) -> "StopRequest":
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
        """The signal to stop for, if any rank received one (same answer on every rank)."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum or 0], device=accelerator.device)
        agreed = int(accelerator.reduce(flag, reduction="sum").item())
        if agreed and self.signum is None:
            self.signum = signal.SIGTERM
        return self.signum if agreed else None


class Stopped(Exception):
    """Training stopped on a signal after writing a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint}")
