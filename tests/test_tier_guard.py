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


def test_a_fixture_costs_what_its_own_definition_cost_not_another_modules_of_its_name(monkeypatch):
    """Two modules define a fixture `reference`: one trains (e2e), one writes files (unit).
    A test of the second, on the xdist worker that set up the first, costs unit (CI's
    7 teardown errors in tests/certify/test_matrix.py, when the cost was keyed by name)."""
    from types import SimpleNamespace

    import conftest

    monkeypatch.setattr(conftest, "_FIXTURE_TIER", {conftest._fixture_key(SimpleNamespace(baseid="tests/train/test_preference_multiprocess.py", argname="reference")): "e2e"})

    def item(baseid: str) -> SimpleNamespace:
        definition = SimpleNamespace(baseid=baseid, argname="reference")
        return SimpleNamespace(fixturenames=["tmp_path", "reference"],
                               _fixtureinfo=SimpleNamespace(name2fixturedefs={"reference": [definition]}))

    assert conftest._fixture_tiers(item("tests/certify/test_matrix.py")) == ["unit", "unit"]
    assert conftest._fixture_tiers(item("tests/train/test_preference_multiprocess.py")) == ["unit", "e2e"]


def test_what_a_test_sets_in_the_environment_is_gone_after_it(monkeypatch):
    """Accelerate's ACCELERATE_USE_DEEPSPEED, set by one test, made later tests on the same
    worker build DeepSpeed (tests/conftest.py environment_restored); and what was there
    before, and was removed, comes back."""
    import os

    from conftest import environment_restored

    monkeypatch.setenv("RUNNER_TEST_KEPT", "1")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with environment_restored():
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        del os.environ["RUNNER_TEST_KEPT"]
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ
    assert os.environ["RUNNER_TEST_KEPT"] == "1"
