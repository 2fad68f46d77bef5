"""The training stream's seed and the loaders' private generators (runner/train/rng.py)."""

from __future__ import annotations

import pytest
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


def _save_states(path, seed: int) -> None:
    """A random_states file as Accelerate's save_state writes it (its keys, torch.save)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.save({"step": 3, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, path)


def test_a_rank_restores_its_own_file_and_a_new_rank_restores_rank_0s(tmp_path):
    from runner.train.rng import random_state_file, restore_random_states

    for rank, seed in ((0, 10), (1, 11)):
        _save_states(tmp_path / f"random_states_{rank}.pkl", seed)
    torch.manual_seed(10)
    rank0 = torch.rand(3)
    torch.manual_seed(11)
    rank1 = torch.rand(3)
    assert random_state_file(tmp_path, 1, saved_world_size=2).name == "random_states_1.pkl"
    assert random_state_file(tmp_path, 1, saved_world_size=1).name == "random_states_0.pkl"  # grew 1 -> 2
    for rank, saved_world, expected in ((1, 2, rank1), (0, 2, rank0), (1, 1, rank0), (3, 2, rank0)):
        torch.manual_seed(99)
        restore_random_states(tmp_path, rank, saved_world)
        assert torch.equal(torch.rand(3), expected), (rank, saved_world)


@pytest.mark.parametrize("damage", ["missing", "truncated", "foreign"])
def test_a_random_state_that_cannot_be_restored_is_an_error_naming_the_file(tmp_path, damage):
    """Accelerate's load_state only logs "Could not load random states" and goes on."""
    from runner.config.errors import UserError
    from runner.train.rng import restore_random_states

    _save_states(tmp_path / "random_states_0.pkl", 1)
    path = tmp_path / "random_states_1.pkl"
    if damage == "truncated":
        _save_states(path, 2)
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "foreign":
        torch.save({"step": 3}, path)
    with pytest.raises(UserError, match=r"random state random_states_1\.pkl cannot be restored"):
        restore_random_states(tmp_path, 1, saved_world_size=2)
