"""train.deterministic, by contract on a CPU: what a GPU run needs to repeat bit for bit is
set in the worker before anything can touch CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from runner.config.spec import RunSpec, TrainSpec
from runner.train import worker
from runner.train.determinism import use_deterministic_kernels
from runner.train.resume import compare


@pytest.fixture
def torch_determinism(monkeypatch):
    """Process-wide switches: put them back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


class SetupReached(Exception):
    """Raised by the stand-in for the worker's second setup step: the test ends there."""


@pytest.mark.e2e  # the worker's own setup, in this process (it stops before the model is built)
def test_deterministic_kernels_are_set_before_anything_touches_cuda(tmp_path, monkeypatch, torch_determinism):
    """The worker's first setup step sets CUBLAS_WORKSPACE_CONFIG (cuBLAS reads it when it
    creates its handle) and torch's deterministic switches; no CUDA call comes before,
    and the model (the first step that may touch CUDA) is built after."""
    events: list[tuple[str, object]] = []
    real = torch.use_deterministic_algorithms

    def recording(mode: bool, **kwargs):
        events.append(("use_deterministic_algorithms", (mode, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))))
        return real(mode, **kwargs)

    def cuda_call(name):
        return lambda *args, **kwargs: events.append(("cuda", name))

    monkeypatch.setattr(torch, "use_deterministic_algorithms", recording)
    for name in ("is_available", "init", "device_count", "manual_seed_all", "set_device", "current_device"):
        monkeypatch.setattr(torch.cuda, name, cuda_call(name))

    def build_model(spec):
        events.append(("build model", (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                                       torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))))
        raise SetupReached

    monkeypatch.setattr(worker, "build_seeded_model", build_model)
    spec = RunSpec(train=TrainSpec(deterministic=True), run_dir=str(tmp_path))
    with pytest.raises(SetupReached):
        worker.train(spec)
    assert events == [("use_deterministic_algorithms", (True, ":4096:8")), ("build model", (True, True, False, ":4096:8"))]


def test_deterministic_off_sets_torch_defaults_back(monkeypatch, torch_determinism):
    """A sweep's jobs share a process: a job without the setting runs with torch's defaults."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own: kept
    use_deterministic_kernels(True)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, False)


def test_a_change_of_the_setting_on_resume_is_accepted_and_reported():
    old, new = RunSpec(), RunSpec(train=TrainSpec(deterministic=True))
    breaking, harmless = compare(old, new, 1, 1)
    assert breaking == [] and harmless == ["train.deterministic: False -> True"]
