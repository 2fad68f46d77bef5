"""Validation against the GPUs of the machine (CUDA queries monkeypatched): settings the
GPU or the library cannot honour are refused before a run starts."""

import pytest
import torch

from runner.config.errors import UserError
from runner.launch.preflight import check_gpu_precision, validate


def _gpus(monkeypatch, *devices):
    """Pretend these (name, capability) GPUs are visible."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: devices[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: devices[index][1])
    # What torch answers on a V100/T4: True, because it counts emulation.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


@pytest.mark.parametrize("name,capability", [("Tesla V100-SXM2-32GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_bf16_is_refused_before_ampere(compose_spec, monkeypatch, name, capability):
    spec = compose_spec("recipe=gpt2_clm_tiny", "precision=bf16")
    _gpus(monkeypatch, (name, capability))
    problems = check_gpu_precision(spec)
    assert len(problems) == 1
    assert name in problems[0] and f"{capability[0]}.{capability[1]}" in problems[0]
    assert "precision=fp16" in problems[0] and "precision=fp32" in problems[0]
    with pytest.raises(UserError, match="needs an Ampere or newer GPU"):
        validate(spec)


def test_bf16_passes_on_ampere_and_newer_and_fp16_is_not_checked(compose_spec, monkeypatch):
    _gpus(monkeypatch, ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H100 80GB HBM3", (9, 0)))
    assert check_gpu_precision(compose_spec("recipe=gpt2_clm_tiny", "precision=bf16")) == []
    _gpus(monkeypatch, ("Tesla T4", (7, 5)))
    assert check_gpu_precision(compose_spec("recipe=gpt2_clm_tiny", "precision=fp16")) == []


def test_one_older_gpu_among_newer_ones_is_enough_to_refuse(compose_spec, monkeypatch):
    _gpus(monkeypatch, ("NVIDIA A100-SXM4-80GB", (8, 0)), ("Tesla T4", (7, 5)))
    assert "Tesla T4" in check_gpu_precision(compose_spec("recipe=gpt2_clm_tiny", "precision=bf16"))[0]
