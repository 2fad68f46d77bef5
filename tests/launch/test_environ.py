"""runner/launch/environ.py: what a launch sets in its process's environment is taken back."""

from __future__ import annotations

import os

import pytest

from runner.launch.environ import restored


def test_each_variable_is_as_it_was_after_the_block_even_when_it_raises(monkeypatch):
    monkeypatch.setenv("RUNNER_TEST_KEPT", "before")
    monkeypatch.delenv("RUNNER_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with restored(["RUNNER_TEST_KEPT", "RUNNER_TEST_NEW"]):
            os.environ["RUNNER_TEST_KEPT"], os.environ["RUNNER_TEST_NEW"] = "during", "during"
            raise RuntimeError("a failed launch")
    assert os.environ["RUNNER_TEST_KEPT"] == "before" and "RUNNER_TEST_NEW" not in os.environ
