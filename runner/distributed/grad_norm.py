"""The gradient norm and clipping of the torch path (ddp, one process, fsdp): exact, and
never a whole gradient copied to float64.

The norm is runner's own (`grad_norm`), not Accelerate's / torch's clip_grad_norm_:
torch's float32 L2 norm kernel on a CPU sums the squares in float32 without
cascading, and on a large tensor loses the small ones (pytorch/pytorch#169237,
#151761). On the micro GPT-2 of tests/test_multiprocess.py, whose norm is mostly the
50257 x 32 embedding gradient, it read 1.4e-5 low at step 1 and 5.4e-4 low at step 12;
FSDP2's two half shards lost about half as much, so fsdp and one process disagreed by
up to 2.7e-4 while their gradients agreed to 1e-7. Each square is accumulated in
float64 instead, as DeepSpeed's ZeRO does for its own norm (get_norm_dtype): every
strategy now reports the norm of the gradients it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate


def clip_and_norm(params: list[Any], max_grad_norm: float) -> torch.Tensor:
    """The L2 norm of `params`' gradients (0-d float64), after which they are clipped to
    `max_grad_norm` when it is > 0. FSDP2's gradients are DTensor shards: the norm over
    them is partial per rank and is completed across ranks (an all-reduce), then each
    shard is clipped by a norm placed on its own mesh."""
    if not params:
        return torch.zeros((), dtype=torch.float64)
    total = grad_norm([p.grad for p in params])
    if max_grad_norm > 0:
        by_mesh: dict[Any, list[Any]] = {}
        for p in params:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for mesh, group in by_mesh.items():
            # float32, the dtype torch's own clip multiplies the gradients by (foreach kernels)
            norm = total.to(device=group[0].grad.device, dtype=torch.float32)
            if mesh is not None:
                norm = DTensor.from_local(norm, mesh)
            torch.nn.utils.clip_grads_with_norm_(group, max_grad_norm, norm)
    return total


# Elements of one gradient cast to float64 at a time, into one buffer reused for every
# chunk. torch's vector_norm(dtype=float64) casts its whole input first: on GPT-2's
# 38.6M-element embedding gradient that is a 295 MB copy at the step's memory peak, on a
# GPU as on a CPU. A new float64 tensor per chunk cost more than the sums themselves on a
# CPU under launch.retain_freed_memory=false: each a fresh mmap, a page fault per 4 KiB
# touched (runner/train/host_memory.py; GPT-2 124M: 337 ms, now 83; bench/grad_norm.py).
# 512K elements is a 4 MB buffer, each of 2 threads' halves the size of its core's L2
# on this project's CPUs: 1M read the same median with slower outliers, 256K and less
# slower as each op's launch and join costs show (36, 41, 56 ms at 512K, 256K, 128K).
NORM_CHUNK_ELEMENTS = 1 << 19


def grad_norm(grads: list[Any]) -> Any:
    """The L2 norm of all `grads` as one vector, each square accumulated in float64 (a
    0-d float64 tensor). DTensor gradients (FSDP2's shards) are summed per device mesh
    and completed across its ranks; plain ones are local (already all-reduced under DDP)."""
    by_layout: dict[Any, list[Any]] = {}
    for g in grads:
        layout = (getattr(g, "device_mesh", None), tuple(getattr(g, "placements", ())))
        by_layout.setdefault(layout, []).append(g)
    device = grads[0].device
    squares = []
    for (mesh, placements), group in by_layout.items():
        local = [g.to_local() if mesh is not None else g for g in group]
        buffer = torch.empty(min(NORM_CHUNK_ELEMENTS, max(g.numel() for g in local)), dtype=torch.float64,
                             device=local[0].device)
        total = torch.stack([_sum_of_squares(g, buffer) for g in local]).sum()
        if mesh is not None:  # each rank summed its own shard: add them up over the sharded mesh dims
            partial = [Partial("sum") if p.is_shard() else Replicate() for p in placements]
            total = DTensor.from_local(total, mesh, partial).full_tensor()
        squares.append(total.to(device))
    return torch.stack(squares).sum().sqrt()


def _sum_of_squares(g: Any, buffer: torch.Tensor) -> Any:
    """The sum of `g`'s squares in float64, a chunk at a time cast into `buffer`."""
    flat = g.reshape(-1)
    if not flat.numel():
        return torch.zeros((), dtype=torch.float64, device=buffer.device)
    sums = []
    for chunk in flat.split(buffer.numel()):
        cast = buffer[: chunk.numel()]
        cast.copy_(chunk)
        # Squared in place and summed, not vector_norm(cast).square(): GPT-2 124M's
        # gradients on 2 CPU threads took 35-37 ms against vector_norm's 49 (and 64 on
        # the one thread runner had run it on; bench/grad_norm.py), the error unchanged.
        # In the step, vector_norm's reduction took 225-240 ms in some steps and 48-55 in
        # others, as its threads' split of the chunk crossed cores; the square is split as
        # the cast is, and square and sum held steady in bench/step_phases.py (each step's
        # norm and clip: docs/benchmarks.md). The BLAS's dot is barely faster (32 ms) and
        # 2e-14 off the whole gradient's float64 sum, where this is within 2e-16.
        sums.append(cast.square_().sum())
    return torch.stack(sums).sum()
