"""Keep freed host memory in the process for the next step, or hand it back to the OS at once.

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
With `launch.retain_freed_memory=false` the opposite is fixed instead: every large
block goes back to the OS when freed, so resident memory is what the worker holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
from typing import Optional

log = logging.getLogger("runner")

# From glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# mallopt takes an int; 2 GiB - 1 is the largest threshold it accepts.
KEEP_BELOW_BYTES = 2**31 - 1
# glibc's starting mmap and trim thresholds (128 KiB), here fixed so they never adapt.
GLIBC_DEFAULT_THRESHOLD_BYTES = 128 * 1024


def retain_freed_memory() -> bool:
    """Serve blocks below 2 GiB from the heap and never trim it. True when applied
    (glibc), False where mallopt is missing or refuses (macOS, musl's no-op)."""
    return _set_thresholds(KEEP_BELOW_BYTES)


def return_freed_memory() -> bool:
    """Serve every block above 128 KiB with its own mmap and unmap it on free, always.

    glibc's default threshold is adaptive: the first large block freed raises it (up to
    32 MiB), after which blocks below it come from the heap, where a freed block behind a
    live one cannot go back to the OS. Over a few training steps a worker's resident
    memory then creeps above what it holds: on GPT-2 small under fsdp x 2 it grew from
    1.8 to 2.1 GB at step end over three steps, where 1.26 GB was live
    (bench/README.md). Setting the thresholds explicitly turns the adaptation off, so
    resident memory follows live memory, at the cost of a page fault per touched page of
    each new large tensor (what retain_freed_memory avoids). True when applied."""
    return _set_thresholds(GLIBC_DEFAULT_THRESHOLD_BYTES)


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    """The C library, looked up once a process: find_library runs `ldconfig -p` (and on
    some systems a compiler) each time, and every run of a worker asks (runner certify
    runs dozens in turn)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _set_thresholds(threshold: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    try:
        mallopt = libc.mallopt
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1
    if not applied:
        log.debug(f"mallopt refused the thresholds ({threshold} bytes); glibc's adaptive defaults stay")
    return applied


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim), after a
    garbage collection: a sweep's next in-process job then starts from, and measures its
    peak above, what is live, not what the job before it retained. True when trimmed."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1
