"""Each optimizer step's non-finite verdict (NaN or inf loss or gradient norm), read
without making a GPU wait when the optimizer can skip a bad update by itself.

Two paths, chosen per step by the trainer (runner/train/trainer.py, `_check_finite`):

- **checked now** (`check_now`): read on the host before the optimizer step. On a GPU
  that is a stream synchronize. Used for optimizers that cannot take a device-side flag
  (foreach AdamW, DeepSpeed's engine), and for a fused AdamW whose parameters live on
  another device than the loss (FSDP2 with offload_params=cpu): the kernel would copy
  the flag from the GPU to the CPU with non_blocking=True, into pageable memory, and
  could read it before the copy lands.
- **deferred** (`hand_to`): the verdict goes to torch's fused AdamW as GradScaler's
  `found_inf`, so the kernel skips the whole update (weights, moments, step count) on
  the device, and the host learns of it later:
  - on a CPU there is nothing to overlap: the verdict is read plainly at the next step;
  - on a GPU it is copied with non_blocking=True into pinned host memory and a CUDA
    event is recorded after the copy. Each step looks only at verdicts whose event has
    completed (`event.query()`, which never waits), oldest first, so the first bad step
    is the one reported however late the host sees it. Before anything is logged,
    evaluated or saved, and at the end, `drain` waits on the events.

Because the host may see a bad verdict some steps late, the flag handed to each step is
the OR of every verdict so far (computed on the device): every step after the first
bad one is skipped too, so the weights and Adam state the run stops with are exactly
those from before the first bad step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NonFiniteStep:
    """A bad step as the host read it."""

    step: int
    loss: float
    grad_norm: float
    skipped_on_device: bool  # fused AdamW skipped it (deferred), or the host stopped before the step


@dataclass
class _Pending:
    step: int
    checks: torch.Tensor  # [loss, grad norm] in fp32, on the device
    host: torch.Tensor | None = None  # pinned host copy (GPU)
    event: Any = None  # torch.cuda.Event recorded after the copy (GPU)


def _read(pending: _Pending, skipped_on_device: bool) -> NonFiniteStep | None:
    """The host's look at one verdict: its pinned copy on a GPU (the event has completed),
    else the tensor itself (a plain read on a CPU, a synchronize on a GPU)."""
    values = pending.host if pending.host is not None else pending.checks.cpu()
    loss, norm = values.tolist()
    if math.isfinite(loss) and math.isfinite(norm):
        return None
    return NonFiniteStep(pending.step, loss, norm, skipped_on_device)


class Verdicts:
    """The verdicts handed to fused AdamW and not yet read on the host, oldest first."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous  # a CUDA device: copy to pinned memory and poll an event
        self.pending: deque[_Pending] = deque()
        self._skip: torch.Tensor | None = None  # device-side OR of all verdicts handed over
        self._holder: torch.optim.Optimizer | None = None  # the optimizer whose found_inf is set

    def check_now(self, step: int, checks: torch.Tensor) -> NonFiniteStep | None:
        """Read this step's verdict before its optimizer step."""
        return _read(_Pending(step, checks), skipped_on_device=False)

    def hand_to(self, optimizer: torch.optim.Optimizer, step: int, checks: torch.Tensor) -> None:
        """Give fused AdamW this step's verdict as `found_inf` and queue its host read."""
        bad = (~torch.isfinite(checks).all()).float()
        self._skip = bad if self._skip is None else torch.maximum(self._skip, bad)
        optimizer.found_inf = self._skip
        self._holder = optimizer
        pending = _Pending(step, checks)
        if self.asynchronous:
            pending.host = torch.empty(checks.shape, dtype=checks.dtype, pin_memory=True)
            pending.host.copy_(checks, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()  # on the current stream, after the copy
        self.pending.append(pending)

    def after_step(self) -> None:
        """The flag belongs to the step just taken: an optimizer step outside the loop (or
        a later fp16 GradScaler) must not see it."""
        if self._holder is not None:
            self._holder.found_inf = None
            self._holder = None

    def poll(self) -> NonFiniteStep | None:
        """The first bad step among the verdicts the device has finished with; never waits."""
        while self.pending and (self.pending[0].event is None or self.pending[0].event.query()):
            bad = _read(self.pending.popleft(), skipped_on_device=True)
            if bad is not None:
                self.pending.clear()
                return bad
        return None

    def drain(self) -> NonFiniteStep | None:
        """The first bad step among all queued verdicts, waiting for the device if needed."""
        while self.pending:
            pending = self.pending.popleft()
            if pending.event is not None:
                pending.event.synchronize()
            bad = _read(pending, skipped_on_device=True)
            if bad is not None:
                self.pending.clear()
                return bad
        return None
