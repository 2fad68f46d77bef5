"""Retained host memory: a freed large tensor's pages are reused, not faulted in again."""

import os
import subprocess
import sys

import pytest

from runner.train.host_memory import retain_freed_memory

# Twenty rounds of a 64 MB tensor, allocated, touched, freed, like a training step's
# activations: the page faults of the last ten. (With retention the heap grows for the
# first few rounds, while small objects settle between the big blocks, then stops.)
ROUNDS = """
import resource, sys
if sys.argv[1] == "retain":
    from runner.train.host_memory import retain_freed_memory
    assert retain_freed_memory()
import torch
for round in range(20):
    if round == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(64 * 2**20 // 4)
    x.sum().item()
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(script: str, mode: str) -> str:
    """The script's output in a fresh process with glibc's and torch's defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    done = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _faults(mode: str) -> int:
    return int(_run(ROUNDS, mode))


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc's (Linux)")
def test_freed_tensors_are_reused_without_new_page_faults():
    default, retained = _faults("default"), _faults("retain")
    # glibc's default unmaps each 64 MB block on free: ~16k faults a round, ~160k in all.
    assert default > 100_000
    assert retained < default / 4, (default, retained)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_applies_on_glibc():
    assert retain_freed_memory() is True


# glibc's adaptive threshold: after the first large free, blocks below it come from the
# heap, where freed blocks pinned below a live one stay resident. Thirty-two 8 MB
# "activations" interleaved with small long-lived tensors, then the big ones freed: the
# MB of resident memory that went back to the OS.
FRAGMENTS = """
import sys
if sys.argv[1] == "return":
    from runner.train.host_memory import return_freed_memory
    assert return_freed_memory()
import torch

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024

first = torch.ones(16 * 2**20 // 4)
del first  # glibc raises its mmap threshold to 16 MB here, unless it is fixed
blocks, pins = [], []
for _ in range(32):
    blocks.append(torch.ones(8 * 2**20 // 4))
    pins.append(torch.ones(256 * 1024 // 4))
before = anon_mb()
del blocks
print(before - anon_mb())
"""


def _returned_mb(mode: str) -> float:
    return float(_run(FRAGMENTS, mode))


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc's (Linux)")
def test_retain_off_returns_freed_blocks_that_the_adaptive_threshold_would_keep():
    """launch.retain_freed_memory=false: resident memory follows what the worker holds."""
    kept_by_default, returned = _returned_mb("default"), _returned_mb("return")
    assert kept_by_default < 64, kept_by_default  # of 256 MB freed, glibc's defaults return little
    assert returned > 240, returned


def test_the_c_library_is_looked_up_once_a_process(monkeypatch):
    """find_library runs `ldconfig -p` each call; a worker asks before each run (runner
    certify: dozens of runs in turn)."""
    import ctypes.util

    from runner.train import host_memory

    calls: list[str] = []
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: calls.append(name) or real(name))
    host_memory._libc.cache_clear()
    try:
        assert host_memory.release_freed_memory() and host_memory.release_freed_memory()
        host_memory.retain_freed_memory()
        host_memory.return_freed_memory()
    finally:
        host_memory._libc.cache_clear()
    assert calls == ["c"]
