"""Keep freed host memory in the process instead of handing it back to the OS.

glibc serves blocks above its mmap threshold (128 KiB to 32 MiB, adaptive) with a
fresh mmap and unmaps them on free. A training step allocates and frees the same large
CPU tensors every time (GPT-2's logits over a 50k vocabulary are 200 MB at batch
8 x 128), so each step page-faults and zeroes them again. Raising the mmap and trim
thresholds makes those blocks come from the heap and stay there for the next step:
the tiny GPT-2 job runs about 2x the tokens/s of glibc's defaults on a 2-core CPU
(bench/README.md, tables A and B).

The cost: the process's resident memory stays near its peak instead of falling
between steps. Done with mallopt at run time, so it works for a worker that is
already running (the in-process worker at world size 1); the environment variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would only work for new processes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("runner")

# From glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# mallopt takes an int; 2 GiB - 1 is the largest threshold it accepts.
KEEP_BELOW_BYTES = 2**31 - 1


def retain_freed_memory() -> bool:
    """Serve blocks below 2 GiB from the heap and never trim it. True when applied
    (glibc), False where mallopt is missing or refuses (macOS, musl's no-op)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BELOW_BYTES) == 1
    if not applied:
        log.debug("mallopt refused the thresholds; freed host memory goes back to the OS")
    return applied
