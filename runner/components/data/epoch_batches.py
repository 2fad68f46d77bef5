"""An epoch's batches for every rank, with the last, partial global batch shared out
exactly: the same samples, with the same weights, as on one process.

Accelerate shards whole per-device batches round-robin. When an epoch's batches do not
fill the last round, its `even_batches` (the default) completes them with samples from
the epoch's start, so on several processes the last global batch trains duplicates one
process never sees (measured: 2 x 4 and 1 x 8 agree to 1e-6 until the epoch's last step,
then step 8 reads 9.6554 against 9.6917). `even_batches=False` instead leaves a rank
short or with nothing, and a collective step needs every rank's forward and backward.

So runner completes the last round itself, with *fillers*: stand-in rows that run the
forward and backward like any other (every rank takes part in each collective, every
shape stays that of a full batch) but train nothing: their labels are all ignored and
they count no real token. Accelerate then has nothing to even out. The loss of a step is
the sum over its trained tokens, on every rank and micro-batch, over their global count
(the trainer's token-weighted windows), so the real samples of the last batch weigh what
they weigh on one process, wherever they landed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

from runner.components.data.labels import IGNORE_INDEX, row_real_tokens
from runner.components.data.preference_batch import SEQUENCE_IDS


@dataclass(frozen=True)
class Filler:
    """A stand-in row: a real row's content (so every shape is a real one's), trained on nowhere."""

    row: Any


class WithFillers(Dataset):
    """The dataset, where an index at or past its end is a filler (the first row's content)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if index >= len(self.dataset):
            return Filler(self.dataset[0])
        return self.dataset[index]


class EpochBatches:
    """The per-device batches of one epoch in the sampler's order, for Accelerate to shard
    round-robin over `world_size` ranks: global step k is the order's samples
    [k * global batch, (k + 1) * global batch) in every layout. With several ranks the
    last round is completed by fillers (indices from len(sampler) on), so every rank gets
    as many batches, each full (on one process, the last batch is filled): none of the
    epoch's samples is trained twice."""

    def __init__(self, sampler: Any, batch_size: int, world_size: int) -> None:
        self.sampler, self.batch_size, self.world_size = sampler, batch_size, world_size
        self.drop_last = False  # read by Accelerate's BatchSamplerShard: nothing is dropped

    def __len__(self) -> int:
        batches = math.ceil(len(self.sampler) / self.batch_size)
        return batches if self.world_size == 1 else math.ceil(batches / self.world_size) * self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        order = list(iter(self.sampler))
        # Fillers, on one process too: a short last batch is completed to full size, so a
        # micro-batch holds the same rows in every layout. Its cross-entropy is the same
        # either way; a model's own addition over a micro-batch's tokens (a mixture of
        # experts' router loss, a product of means over them) is not.
        order += range(len(order), len(self) * self.batch_size)
        for start in range(0, len(order), self.batch_size):
            yield order[start:start + self.batch_size]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def masking_fillers(collate: Callable[[list[Any]], dict[str, torch.Tensor]]) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    """`collate` over rows that may hold fillers: those are collated as the rows they copy,
    then their labels are all ignored and they count no real token (`real_tokens`, one a
    row, as packed rows carry it)."""

    def collate_with_fillers(rows: Sequence[Any]) -> dict[str, torch.Tensor]:
        fillers = torch.tensor([isinstance(row, Filler) for row in rows])
        batch = collate([row.row if isinstance(row, Filler) else row for row in rows])
        if not bool(fillers.any()):
            return batch
        # A row may stand for several sequences, laid out as blocks of one sequence a row
        # (a preference pair's chosen answers, then its rejected ones: preference_batch.py).
        sequences = fillers.repeat(2 if SEQUENCE_IDS in batch else batch["labels"].shape[0] // len(rows))
        labels = batch["labels"].clone()  # run_clm's blocks: the labels are the input ids, one tensor
        if SEQUENCE_IDS in batch:  # packed pairs: a filler's sequences share rows with real ones
            owner = batch[SEQUENCE_IDS]
            filled = sequences[owner.clamp(min=0)] & (owner >= 0)
            labels[filled] = IGNORE_INDEX
            return {**batch, "labels": labels, "real_tokens": batch["real_tokens"] - filled.sum(dim=1)}
        labels[sequences] = IGNORE_INDEX
        return {**batch, "labels": labels, "real_tokens": row_real_tokens(batch).masked_fill(sequences, 0)}

    return collate_with_fillers


def epoch_order_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's order: the run's seed for epoch 0 (torch's
    RandomSampler with a generator seeded so gives the same order), then a hash of
    (seed, epoch). Not seed + epoch: seed s+1's epoch e would be seed s's epoch e+1, and
    a seed sweep's runs would share their data orders."""
    if epoch == 0:
        return seed
    digest = hashlib.sha256(f"runner-epoch-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class EpochSampler:
    """Shuffles with a seed derived from (seed, epoch), so epoch e's order is known
    without replaying epochs 0..e-1: a resumed run continues the exact order."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]

        generator = torch.Generator().manual_seed(epoch_order_seed(self.seed, self.epoch))
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples
