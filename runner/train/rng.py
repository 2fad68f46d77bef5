"""Where a run's random numbers come from, and how a resume continues them exactly.

Each rank's random state is seeded, saved and restored like this:

1. **Initial weights.** `set_seed(train.seed)` on every rank before the model is
   built, so the weights are the same on every rank and in every layout (ZeRO-3 too).
2. **The training stream.** Setup draws from the global generators a varying number
   of times: a data-cache miss draws and a hit does not, and so do the first run's
   peak-FLOPs probe and the engines' set-up. `seed_training_stream` re-seeds torch
   (CPU and CUDA), Python and NumPy just before the first step, from a seed derived
   from train.seed. Dropout's stream therefore never depends on what setup did.
   Every rank gets the same seed, as with Accelerate's `set_seed` and Megatron's
   default for data-parallel ranks: each rank draws the same masks for different
   samples.
3. **Loaders draw privately.** Each DataLoader takes its per-iterator seed from a
   generator of its own (`loader_generator`), never from the global one. Starting an
   epoch, skipping batches on resume or evaluating never moves the dropout stream.
4. **Saved and restored per rank.** Accelerate's `save_state` writes each rank's
   torch, CUDA, Python and NumPy states (`random_states_<rank>.pkl`) at the
   optimizer-step boundary where the checkpoint is taken. `load_state` restores
   them after everything else is built (step 2 included), so the first step after a
   resume draws exactly what the uninterrupted run drew there.
"""

from __future__ import annotations

import hashlib

import torch
from accelerate.utils import set_seed


def training_stream_seed(seed: int) -> int:
    """A seed for the training stream, distinct from the one the weights were drawn
    with (so dropout masks are not a replay of the initialisation draws)."""
    return int.from_bytes(hashlib.sha256(f"runner-training-stream:{seed}".encode()).digest()[:4], "little")


def seed_training_stream(seed: int) -> None:
    """Re-seed every global generator on this rank for the training loop (step 2 above)."""
    set_seed(training_stream_seed(seed))


def loader_generator(seed: int) -> "torch.Generator":
    """A private generator for a DataLoader's per-iterator seed (step 3 above)."""
    return torch.Generator().manual_seed(seed)
