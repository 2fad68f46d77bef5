"""Retained host memory: a freed large tensor's pages are reused, not faulted in again."""

import os
import subprocess
import sys

import pytest

from runner.host_memory import retain_freed_memory

# Twenty rounds of a 64 MB tensor, allocated, touched, freed, like a training step's
# activations: the page faults of the last ten. (With retention the heap grows for the
# first few rounds, while small objects settle between the big blocks, then stops.)
ROUNDS = """
import resource, sys
if sys.argv[1] == "retain":
    from runner.host_memory import retain_freed_memory
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


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc's (Linux)")
def test_freed_tensors_are_reused_without_new_page_faults():
    default, retained = _faults("default"), _faults("retain")
    # glibc's default unmaps each 64 MB block on free: ~16k faults a round, ~160k in all.
    assert default > 100_000
    assert retained < default / 4, (default, retained)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_applies_on_glibc():
    assert retain_freed_memory() is True
