"""On a GPU, the chunked loss's kernel is Liger's fused linear cross-entropy when
liger-kernel is installed (`pip install "runner[liger]"`): the same sum, the head's
matmul and the cross-entropy fused in Triton chunk by chunk, gradients computed in
forward as runner's own chunks do (runner/components/chunked_loss.py), which stay the
kernel on a CPU, on a GPU without liger-kernel, and for the memory plan's trace.

Only Liger's public module is used (`LigerFusedLinearCrossEntropyLoss`, its keyword
arguments and `forward(lin_weight, _input, target, bias)`), with the arguments that make
it runner's loss: the sum over tokens (runner divides, as transformers does), -100 not
trained, and the weight's gradient accumulated in fp32 as runner's chunks accumulate it
(under ZeRO's bf16 the weight itself is bf16). Its Triton kernels need a GPU driver:
tests/components/test_liger_loss.py checks this wiring against the installed Liger's
module with its kernel replaced by the same computation in torch.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Optional

import torch

from runner.components.data.labels import IGNORE_INDEX

HeadLoss = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


def installed_version(library: str) -> Optional[str]:
    """The installed version of `library`, None when it is not installed (read here:
    components/ never imports distributed/, where runner/distributed/patches.py reads its own)."""
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_present() -> bool:
    return torch.cuda.is_available()


def runs_on(hidden: torch.Tensor) -> bool:
    """Liger's kernels run on this tensor's device (Triton on CUDA or ROCm)."""
    return hidden.device.type == "cuda"


def liger_head_loss() -> tuple[Optional[HeadLoss], str]:
    """(Liger's summed head loss as (flat hidden, weight, bias, flat aligned labels) ->
    0-d loss, what it is) on a machine with a GPU and liger-kernel; else (None, why not)."""
    version = installed_version("liger-kernel")
    if version is None:
        return None, "liger-kernel is not installed"
    if not gpu_present():
        return None, f"liger-kernel {version} installed, but no GPU"
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)

    def head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  labels: torch.Tensor) -> Any:
        return fused(weight, hidden, labels, bias)

    return head_loss, f"Liger's fused linear cross-entropy (liger-kernel {version})"
