"""Setup step 4's loaders (runner/train/loaders.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("cuda", [True, False])
def test_loaders_pin_host_memory_on_a_gpu(compose_spec, monkeypatch, cuda):
    from types import SimpleNamespace

    from runner.train.loaders import make_loaders

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    data = SimpleNamespace(train=[{"input_ids": torch.zeros(4, dtype=torch.long)}] * 8,
                           validation=[{"input_ids": torch.zeros(4, dtype=torch.long)}] * 4, pad_id=0)
    loaders = make_loaders(compose_spec("recipe=gpt2_clm_tiny"), data, 1)
    train, evaluation = loaders.train, loaders.evaluation
    assert train.pin_memory is cuda and evaluation.pin_memory is cuda
