"""The Accelerator: built from the strategy object and the precision, and what runner
changes about Accelerate itself (the fp32 copy of the outputs, its process-wide state).

What each strategy adds (a plugin, a step of its own) is its strategy object's
(runner/distributed/strategy.py); what is checked after prepare() is
runner/distributed/engagement.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from types import MethodType
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration
from accelerate.utils.operations import ConvertOutputsToFp32

from runner.config.spec import PrecisionKind
from runner.distributed.zero_patches import forget_world_group
from runner.distributed.patches import SKIP_OUTPUT_UPCAST, engaged
from runner.distributed.strategy import MIXED_PRECISION, Strategy


def dataloader_config(cuda: bool) -> DataLoaderConfiguration:
    """On a GPU, batches are copied host-to-device with non_blocking=True, from pinned
    memory (the worker's loaders set pin_memory): the copy overlaps the previous step
    instead of making the host wait. On a CPU there is no copy to overlap."""
    return DataLoaderConfiguration(non_blocking=cuda)


def build_accelerator(
    strategy: Strategy,
    grad_accum_steps: int,
    max_grad_norm: float,
    timeout_minutes: float = 30.0,
    tracking: str = "none",
    logging_dir: Optional[str] = None,
    per_device_batch_size: int = 1,
    model_type: str = "gpt2",
    hidden_size: Optional[int] = None,
    layer_parameters: int | None = None,
    layer_classes: Sequence[str] = (),
) -> Accelerator:
    """per_device_batch_size is DeepSpeed's micro batch (used under ZeRO only);
    hidden_size (the model's width) sizes ZeRO's buckets, and on a GPU
    layer_parameters (one transformer layer's) its prefetch; layer_classes (the model's
    transformer-layer classes) are what FSDP2 wraps (used under fsdp only)."""
    cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    options = strategy.accelerator_options(
        cuda=cuda, grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
        per_device_batch_size=per_device_batch_size, world_size=world_size, hidden_size=hidden_size,
        model_type=model_type, layer_parameters=layer_parameters, layer_classes=layer_classes,
    )
    handlers: list[Any] = []
    if strategy.needs_process_group() or world_size > 1:
        # Passing a backend makes Accelerate initialise a process group: only when distributed.
        backend = "nccl" if cuda else "gloo"
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timedelta(minutes=timeout_minutes)))
    accelerator = Accelerator(
        dataloader_config=dataloader_config(cuda),
        mixed_precision=MIXED_PRECISION[strategy.precision.kind],
        gradient_accumulation_steps=grad_accum_steps,
        kwargs_handlers=handlers,
        # No dynamo_backend: model.compile compiles each layer in place before prepare()
        # (runner/components/compile.py), the same way under every strategy.
        log_with=None if tracking == "none" else tracking,
        project_config=ProjectConfiguration(logging_dir=logging_dir) if logging_dir else None,
        **options,
    )
    if strategy.precision.kind is PrecisionKind.fp32:
        keep_tf32_off()
    strategy.after_accelerator(accelerator)
    return accelerator


def keep_tf32_off() -> None:
    """fp32 means fp32 matmuls and convolutions, as the README and the MFU peak (the fp32
    one, not TF32's) assume. Accelerate turns TF32 matmuls on by itself whenever a dynamo
    backend is set in fp32 on a GPU (AcceleratorState.__init__ in accelerate/state.py:
    `torch.backends.cuda.matmul.allow_tf32 = True`), so model.compile=true would silently
    trade 13 bits of mantissa for speed; cudnn's flag is torch's own default (True)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def describe(accelerator: Accelerator) -> dict[str, Any]:
    """What is in effect, for the banner and checks."""
    state = accelerator.state
    return {
        "world_size": accelerator.num_processes,
        "device": str(accelerator.device),
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "mixed_precision": accelerator.mixed_precision,
        "backend": getattr(state, "backend", None),
    }


def unwrap(accelerator: "Accelerator", model: Any) -> Any:
    """The bare model under DDP / DeepSpeed / torch.compile, leaving `model` intact.

    Accelerate's default (keep_torch_compile=True) re-points the compiled wrapper at the
    bare model (`compiled._orig_mod = bare`): on torch.compile over DDP, that silently
    removes DDP from the model being trained, and the ranks drift apart.
    """
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def skip_output_upcast(accelerator: "Accelerator", model: Any) -> bool:
    """Keep Accelerate's autocast on the forward but drop its cast of every output to fp32.

    Under bf16/fp16 Accelerate wraps forward so that all outputs come back in fp32, for
    losses computed outside the model. runner's loss comes from inside the model, which
    computes it in fp32 already, so the wrapper only copies the logits: batch x block x
    vocabulary values (400 MB a step at 8 x 128 x 50k) that nothing reads in training.
    Measured on the tiny recipe in bf16 on a CPU: bench/README.md. Returns True when the
    wrapper was found and removed; False (nothing changed) under fp32, DeepSpeed, an
    Accelerate whose wrapper looks different, or one it was not verified on
    (runner/distributed/patches.py).
    """
    if not engaged(SKIP_OUTPUT_UPCAST):
        return False
    base = unwrap(accelerator, model)  # keeps the wrappers; strips DDP / torch.compile
    forward = base.__dict__.get("forward")
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        return False
    inner = converter.model_forward  # the autocast-wrapped forward
    # Accelerate wrapped either the unbound function (rebind it) or a bound callable.
    base.forward = MethodType(inner, base) if hasattr(forward, "__func__") else inner
    return True


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons (and DeepSpeed's cached world group),
    so the next in-process run (a sweep's next job) can choose another precision or
    strategy."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    forget_world_group()
