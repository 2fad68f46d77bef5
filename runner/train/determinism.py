"""train.deterministic: the same numbers on every run of a GPU, at a cost in speed.

On a CPU a run already repeats bit for bit (and a resume in the same layout continues
bit for bit). On a GPU it does not by default: the backward of the embedding and of
SDPA/flash attention, and some cuBLAS reductions, accumulate with atomics in whatever
order the threads finish, so two runs (or a run and its resume) drift apart in the last
bits from the first step and the drift grows. `train.deterministic=true` asks torch for
kernels that always sum in one order.
"""

from __future__ import annotations

import os

import torch

# cuBLAS needs a fixed workspace per stream to reduce in a fixed order (CUDA >= 10.2); it
# reads this when it creates its handle, at the first matmul, so it must be set before.
# ":4096:8" (8 buffers of 4 MiB) is the faster of the two settings NVIDIA documents.
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_kernels(enabled: bool) -> None:
    """Called first in each worker's setup, before any CUDA call. Off, torch's defaults
    are set back (fast, non-deterministic kernels on a GPU): a sweep runs its jobs one
    after another in one process, and one job's setting must not leak into the next."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # a user's own setting wins
    # On, an op that has no deterministic kernel raises, naming itself, rather than
    # quietly breaking the promise.
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False  # torch's default; autotuning may pick another algorithm each run
