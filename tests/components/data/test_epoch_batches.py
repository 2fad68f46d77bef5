"""An epoch's last, partial global batch: every layout trains each sample of the epoch
once, at the step one process trains it, and the ranks' fillers train nothing.

The loaders are the worker's own (runner/train/loaders.py), sharded per rank by Accelerate's
BatchSamplerShard exactly as `prepare()` shards them on several processes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard

from runner.components.data.epoch_batches import Filler, masking_fillers
from runner.components.data.instruct import pad_batch, stack_packed
from runner.components.data.labels import IGNORE_INDEX, real_tokens

ROWS = 4  # tokens a row


def worker_loader(compose_spec, n_rows: int, per_device: int, world: int):
    from runner.train.loaders import make_loaders

    rows = [{"input_ids": torch.full((ROWS,), i, dtype=torch.long)} for i in range(n_rows)]
    data = SimpleNamespace(train=rows, validation=rows[:2], pad_id=0)
    spec = compose_spec("recipe=gpt2_clm_tiny", f"train.per_device_batch_size={per_device}")
    return make_loaders(spec, data, world).train


def rank_batches(loader, world: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """What one rank's prepared loader yields: Accelerate's shard of the batch sampler
    (even_batches=True, its default; one process is not sharded), each batch fetched and
    collated by the loader."""
    shard = loader.batch_sampler if world == 1 else BatchSamplerShard(
        loader.batch_sampler, num_processes=world, process_index=rank, even_batches=True)
    return [loader.collate_fn([loader.dataset[i] for i in indices]) for indices in shard]


@pytest.mark.parametrize("n_rows, per_device, world, accum", [
    (60, 4, 2, 1),   # the case: the last step's 4 samples on rank 0, rank 1 has none
    (26, 4, 2, 1),   # the last step's 2 samples: rank 0's batch half fillers, rank 1's all fillers
    (26, 2, 2, 2),   # with accumulation: the last window one micro-batch a rank, rank 1's fillers
    (23, 3, 3, 1),   # a third rank
    (60, 8, 1, 1),   # one process: a short last batch, no filler
])
def test_each_sample_is_trained_once_at_the_step_one_process_trains_it(compose_spec, n_rows, per_device, world, accum):
    loader = worker_loader(compose_spec, n_rows, per_device, world)
    loader.batch_sampler.set_epoch(0)
    order = list(loader.batch_sampler.sampler)
    per_rank = [rank_batches(loader, world, rank) for rank in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "every rank must run as many micro-batches"
    global_batch = per_device * world * accum
    trained_at_step: dict[int, list[int]] = {}
    for rank, batches in enumerate(per_rank):
        for micro, batch in enumerate(batches):
            assert batch["input_ids"].shape == (per_device, ROWS) or world == 1
            trained = batch["labels"][:, 0] != IGNORE_INDEX
            assert real_tokens(batch) == int(trained.sum()) * ROWS  # fillers count no real token
            step = micro // accum
            trained_at_step.setdefault(step, []).extend(batch["input_ids"][trained, 0].tolist())
    assert sorted(trained_at_step) == list(range(math.ceil(n_rows / global_batch)))
    for step, samples in trained_at_step.items():  # one process's step: the order's next global batch
        assert sorted(samples) == sorted(order[step * global_batch:(step + 1) * global_batch]), step


def test_fillers_train_nothing_in_every_format():
    """A filler collates as the row it copies (the same shapes), with every label ignored
    and no real token, in run_clm's blocks, padded and packed instruction rows."""
    from runner.components.data.prepare import collate

    block = {"input_ids": torch.arange(4)}
    padded = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])}
    packed = {"input_ids": torch.arange(4), "labels": torch.tensor([-100, 1, 2, -100]),
              "position_ids": torch.tensor([0, 1, 0, 1]), "real_tokens": torch.tensor(4)}
    for inner, row in ((collate, block), (lambda rows: pad_batch(rows, pad_id=0), padded), (stack_packed, packed)):
        batch = masking_fillers(inner)([row, Filler(row)])
        assert (batch["labels"][1] == IGNORE_INDEX).all() and (batch["labels"][0] != IGNORE_INDEX).any()
        assert batch["real_tokens"].tolist() == [real_tokens(inner([row])), 0]
        assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])
    # run_clm's labels are its input ids: masking a filler's must leave the inputs alone
    batch = masking_fillers(collate)([block, Filler(block)])
    assert torch.equal(batch["input_ids"][1], torch.arange(4))
