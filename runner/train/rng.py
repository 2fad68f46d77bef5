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
   resume draws exactly what the uninterrupted run drew there. Accelerate only logs
   a file it cannot read ("Could not load random states") and goes on with the
   state it had; `restore_random_states` reads the file again and makes that an error.
5. **Another number of processes.** A rank the checkpoint had no file for (the run
   grew from 1 to 2 processes) starts from rank 0's state: the state every rank of
   the old run held, since every rank is seeded alike and draws the same shapes.
   Dropout masks still differ from an uninterrupted run's once the per-rank batch
   changes, which the resume notes say.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import set_seed

from runner.config.errors import UserError

RNG_STATE_FILE = "random_states_{rank}.pkl"  # Accelerate's name (accelerate.utils.constants.RNG_STATE_NAME)


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


def random_state_file(checkpoint: Path, rank: int, saved_world_size: int) -> Path:
    """The file rank `rank` restores its random state from (point 5 above)."""
    return checkpoint / RNG_STATE_FILE.format(rank=rank if rank < saved_world_size else 0)


def read_random_states(path: Path) -> dict:
    """One rank's saved generators; a missing, truncated or foreign file is a UserError naming it."""
    try:
        # Accelerate pickles Python's and NumPy's states: not loadable with weights_only.
        states = torch.load(path, weights_only=False)
        missing = [k for k in ("random_state", "numpy_random_seed", "torch_manual_seed") if k not in states]
        if missing:
            raise ValueError(f"no {', '.join(missing)} in it")
    except Exception as err:
        raise UserError(
            f"checkpoint {path.parent}: the random state {path.name} cannot be restored ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); without it the dropout stream would not continue. "
            "Resume from an older checkpoint (resume=PATH) or start a new run."
        ) from None
    return states


def restore_random_states(checkpoint: Path, rank: int, saved_world_size: int) -> None:
    """Set this rank's torch (CPU and CUDA), Python and NumPy generators from the checkpoint."""
    states = read_random_states(random_state_file(checkpoint, rank, saved_world_size))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available():
        # One state per visible device when saved; a rank may now see fewer devices.
        for device, state in enumerate(states.get("torch_cuda_manual_seed", [])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)
