"""Imported by the forkserver after the worker's own modules (runner/launch/start_method.py):
what every worker would otherwise import after its fork, each worker again.

The worker's modules import transformers, peft, DeepSpeed and matplotlib where they are
used, not at the top (`runner --help` and a mistyped key answer in a second). A forked
worker then imported them itself: about 1,700 modules in its first run, 9 CPU-s each
on this 2-core machine (measured in `runner certify gpt2`: rank 1 imported 1,688 modules
in its ddp run and 659 more in its zero2 run; the heaviest: torch's inductor config,
which torch.use_deterministic_algorithms imports, 1.2 s; transformers.optimization,
which brings its Trainer's utilities and peft, 2.3 s; DeepSpeed, which Accelerate's
unwrap_model imports, 1.0 s, and the ZeRO engine's optimizer check, 1.8 s; matplotlib,
0.6 s). Imported once here, each fork has them.

A module that fails to import is left to the worker, which meets the same error where
it needs the module and reports it there: this list is a hint, never a requirement.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os

# What a worker imports on every run, in the order it meets them (determinism, model,
# schedule, unwrap, the loss curve).
EVERY_RUN = (
    "torch._inductor.config",
    "transformers.modeling_utils",
    "transformers.optimization",
    "transformers.tokenization_utils_tokenizers",
    "accelerate.utils.other",
    "deepspeed",
)
# What a ZeRO run adds: the engine, and the optimizer check's modules (DeepSpeed's own
# path; if a release moves it, the worker imports what it needs as before).
ZERO_RUN = ("deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer")


def preload(names: tuple[str, ...]) -> list[str]:
    """Import each module that is installed; the names that could not be imported."""
    missed = []
    for name in names:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # left to the worker (the module docstring)
            missed.append(name)
    return missed


# The server draws no plots: the backend workers use (runner/report/plots.py), chosen
# before pyplot is imported.
os.environ.setdefault("MPLBACKEND", "Agg")
preload((*EVERY_RUN, *ZERO_RUN, "matplotlib.pyplot"))
# What the server holds now is never garbage to a worker: out of the collector's sight, a
# worker's collections (one before each run, runner/train/host_memory.py) scan only what
# it made itself (0.5 s each, 2 x 9 a `runner certify gpt2`, before), and they never
# write to these objects' pages, which a fork shares until written (Python's gc.freeze).
gc.freeze()
