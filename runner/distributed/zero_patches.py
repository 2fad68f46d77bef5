"""Changes to DeepSpeed ZeRO's private state that runner makes where they save memory or
let several ZeRO jobs run in one process. Each reaches into attributes DeepSpeed does not
publish, so each is fenced by the DeepSpeed versions it was verified on
(runner/distributed/patches.py: engaged) and left out on any other; the banner says which
are engaged. Used by runner/distributed/deepspeed.py's ZeroStrategy.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from runner.distributed.patches import (
    DEEPSPEED_FORGET_WORLD_GROUP,
    ZERO3_RELEASE_GRADIENT_PARTITION,
    ZERO3_SHARE_FP32_MASTER,
    engaged,
)


def offload_device(config: Any) -> str:
    """The device of a DeepSpeed offload config (engine.zero_offload_optimizer() /
    zero_offload_param()): "none" when there is none."""
    device = getattr(config, "device", None)
    # An enum in older DeepSpeed, a plain string (use_enum_values) in 0.19.
    return str(getattr(device, "value", device) or "none")


def _gradient_partition(engine: Any) -> Any:
    """ZeRO-3's flat fp32 gradient partition when runner may release it between steps;
    None under ZeRO-1/2, or when an offload moves it (DeepSpeed then swaps its `.data`)."""
    zero = getattr(engine, "optimizer", None)
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    offloaded = {offload_device(engine.zero_offload_optimizer()), offload_device(engine.zero_offload_param())}
    if flat is None or offloaded != {"none"}:
        return None
    return flat


# DeepSpeed's per-parameter views of the flat partition (a name-mangled private dict of
# DeepSpeedZeroOptimizer_Stage3; partition_grads writes each reduced gradient through it).
_GRAD_VIEWS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def release_gradient_partition(engine: Any) -> None:
    """Free ZeRO-3's gradient partition once the optimizer has stepped, until the end of
    the next backward.

    DeepSpeed allocates every rank's partition of the gradients (fp32, a quarter of the
    model states at 2 ranks) once and keeps it for the whole run, though it only holds
    data from the first gradient reduced in an accumulation window to the step that
    closes it. ZeRO-3 peaks at the start of backward, where every layer's activations,
    the gathered tied embedding and its full-size gradient are live: the partition
    there, kept or reallocated by the first reduced gradient, was 237 MB of that peak on
    GPT-2 small x 2 in fp32 (bench/README.md). FSDP2 frees its gradients at zero_grad
    for the same reason.

    The storage is emptied in place, so DeepSpeed's views of it stay valid. In the next
    window's first backward (DeepSpeed copies, not adds, each reduced gradient then),
    each parameter's reduced gradient goes to a tensor of its own, allocated as the
    backward frees activations; the backward's epilogue reallocates the partition,
    zeroed, moves them in and points DeepSpeed's views back (`restore_gradient_partition`).
    Any other use of the empty partition fails loudly instead of reading stale values."""
    flat = _gradient_partition(engine)
    if flat is None or not engaged(ZERO3_RELEASE_GRADIENT_PARTITION):
        return
    zero = engine.optimizer
    if not getattr(zero, "_runner_defers_grad_partition", False):
        _defer_gradient_partition(engine)
    flat.untyped_storage().resize_(0)


def _defer_gradient_partition(engine: Any) -> None:
    """Route DeepSpeed's writes into a released partition to per-parameter tensors, and
    reallocate it at the end of backward (see release_gradient_partition)."""
    zero = engine.optimizer
    write, close = zero.partition_grads, zero.independent_gradient_partition_epilogue
    views = getattr(zero, _GRAD_VIEWS, None)  # None: another DeepSpeed; reallocate at the first write
    zero._runner_staged_grads = {}  # ds_id -> DeepSpeed's view of the partition, while staged

    def partition_grads(params: list, grad_partitions: list) -> Any:
        flat = zero.grad_partitions_flat_buffer
        if views is not None and zero.micro_step_id == 0 and flat.untyped_storage().nbytes() == 0:
            for param in params:
                if param.ds_id not in zero._runner_staged_grads:
                    zero._runner_staged_grads[param.ds_id] = views[param.ds_id]
                    # Zeroed: DeepSpeed skips a rank's all-padding partitions and writes only
                    # the real part of a padded one; the rest must read 0 as it did before.
                    views[param.ds_id] = torch.zeros_like(views[param.ds_id])
        else:
            restore_gradient_partition(engine)
        return write(params, grad_partitions)

    def epilogue() -> None:
        close()
        if zero._runner_staged_grads:
            restore_gradient_partition(engine)
            close()  # again, with nothing left to reduce: its per-group gradient lists now point into the partition

    zero.partition_grads = partition_grads
    zero.independent_gradient_partition_epilogue = epilogue
    zero._runner_defers_grad_partition = True


def restore_gradient_partition(engine: Any) -> None:
    """Reallocate, zeroed, ZeRO-3's gradient partition if `release_gradient_partition`
    freed it, moving in the gradients staged since; a no-op otherwise."""
    flat = _gradient_partition(engine)
    if flat is None or flat.untyped_storage().nbytes() != 0:
        return
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    flat.zero_()
    zero = engine.optimizer
    staged = getattr(zero, "_runner_staged_grads", {})
    views = getattr(zero, _GRAD_VIEWS, {})
    for ds_id, view in staged.items():
        view.copy_(views[ds_id])
        views[ds_id] = view
    staged.clear()


def share_zero3_fp32_master(engine: Any) -> int:
    """Under ZeRO-3 in fp32, make the optimizer's fp32 partition the working partition
    itself instead of a second copy of it; returns the bytes freed (0: nothing to share).

    When the working weights are already fp32 on the optimizer's device, DeepSpeed
    means to skip its master copy, but it compares `tensor.device == "cpu"` (or
    "cuda:0"), a torch.device against a string, which is never equal: every rank then
    keeps two fp32 copies of its partition (measured in bench/README.md). The step
    copies the master partition into the working one after each update, a copy onto
    itself once they share storage, so the math is unchanged. Only a bit-equal copy of
    the same shape, dtype and device is shared."""
    if not engaged(ZERO3_SHARE_FP32_MASTER):
        return 0
    zero = getattr(engine, "optimizer", None)
    working = getattr(zero, "fp16_partitioned_groups_flat", None)
    master = getattr(zero, "fp32_partitioned_groups_flat", None)
    if not working or not master or len(working) != len(master):
        return 0
    freed = 0
    for low, high in zip(working, master):
        if low is None or high.numel() == 0 or high.data_ptr() == low.data_ptr():
            continue
        if (low.dtype, low.device, low.shape) != (high.dtype, high.device, high.shape) or not torch.equal(low, high):
            continue
        freed += high.numel() * high.element_size()
        high.data = low.data
    return freed


def forget_world_group() -> None:
    """Forget DeepSpeed's cached clone of the world process group.

    DeepSpeed caches it in a module global; once this run's group is destroyed the
    clone is stale, and the next in-process ZeRO job (a one-process ZeRO sweep) fails
    in initialize() with "Group ... is not registered"."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and engaged(DEEPSPEED_FORGET_WORLD_GROUP):
        groups._WORLD_GROUP = None
