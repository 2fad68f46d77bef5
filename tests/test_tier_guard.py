"""The tier guard (tests/conftest.py): which child processes count as a test's cost."""

from __future__ import annotations

import pytest
from conftest import _is_tool


@pytest.mark.parametrize("program", ["gcc", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "cc", "ld", "ninja",
                                     "fc-list", "ldconfig"])
def test_compilers_and_probes_that_libraries_run_cost_no_tier(program):
    """DeepSpeed test-compiles against libaio with the Python's own compiler, which on
    Debian's Python is x86_64-linux-gnu-gcc."""
    assert _is_tool(program)


@pytest.mark.parametrize("program", ["python", "python3", "torchrun", "runner", "srun", "bash"])
def test_a_run_or_a_cluster_command_is_not_a_tool(program):
    assert not _is_tool(program)
