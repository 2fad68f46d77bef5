"""The training stream's seed and the loaders' private generators (runner/train/rng.py)."""

from __future__ import annotations

import torch

from runner.train.rng import loader_generator, seed_training_stream, training_stream_seed


def test_the_training_stream_is_seeded_apart_from_the_weights_and_reproducibly():
    assert training_stream_seed(42) == training_stream_seed(42)
    assert len({training_stream_seed(s) for s in (0, 1, 42)} | {0, 1, 42}) == 6


def test_setup_draws_do_not_reach_the_training_stream():
    torch.manual_seed(0)
    seed_training_stream(7)
    clean = torch.rand(3)
    torch.manual_seed(0)
    torch.rand(100)  # a probe, a cache miss: setup drawing a varying amount
    seed_training_stream(7)
    assert torch.equal(torch.rand(3), clean)


def test_a_loader_with_its_own_generator_leaves_the_global_stream_alone():
    data = list(range(8))
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    for _ in torch.utils.data.DataLoader(data, batch_size=4, generator=loader_generator(0)):
        pass
    assert torch.equal(torch.rand(1), expected)
    torch.manual_seed(0)
    for _ in torch.utils.data.DataLoader(data, batch_size=4):  # the default draws from the global stream
        pass
    assert not torch.equal(torch.rand(1), expected)
