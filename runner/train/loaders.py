"""Setup step 4: the run's data and its loaders (runner/train/worker.py names the steps).

The cached path tokenizes once per machine (its local rank 0 first) and leaves the sharding
to Accelerate; a stream (`data.streaming=true`) is each rank's own share, read as it trains,
through a stateful loader whose position a checkpoint holds.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from runner.components.data.epoch_batches import EpochBatches, EpochSampler, WithFillers, masking_fillers
from runner.components.data.prepare import PreparedData, collate, collate_for
from runner.components.data.prepare import prepare as prepare_data
from runner.components.data.prompts import prepare_prompts
from runner.components.data.stream import BadRecord, BlockStream, StreamedData, open_stream, training_files
from runner.config.batch import eval_batch_size
from runner.config.errors import USAGE_EXIT_CODE, TrainingStopped
from runner.config.spec import DataFormat, RunSpec
from runner.train.rng import loader_generator

log = logging.getLogger("runner")


@dataclass
class Loaders:
    train: DataLoader
    evaluation: DataLoader
    sampler: EpochSampler | BlockStream  # the trainer sets its epoch


def load_data(spec: RunSpec, accelerator: Accelerator, tokenizer: Any, block_size: int) -> PreparedData | StreamedData:
    if spec.data.streaming:  # this rank's share, read as it trains
        try:
            streamed = open_stream(spec.data, tokenizer, block_size, spec.train.seed,
                                   accelerator.process_index, accelerator.num_processes)
        except BadRecord as err:  # the launcher read these blocks too; a file changed since
            log.error(f"runner: error: {err.line}")
            raise TrainingStopped(USAGE_EXIT_CODE, err.line) from None
        if accelerator.is_main_process:
            log.info(f"data: {streamed.source}; {len(streamed.validation)} eval blocks read in {streamed.seconds:.1f}s")
        return streamed
    # Tokenize once per machine (its local rank 0); the other ranks then read the cache.
    if spec.data.format is DataFormat.prompts:  # online RL: the records as they are
        return prepare_prompts(spec.data, tokenizer, block_size)
    with accelerator.local_main_process_first():
        data = prepare_data(spec.data, tokenizer, block_size)
    if accelerator.is_main_process:
        log.info(f"data: {'reused' if data.cache_hit else 'built'} {data.cache_path} in {data.seconds:.1f}s")
        if data.mixture is not None:
            for figure in data.mixture.figures:
                log.info(f"data: mixture: {figure.name}: {figure.examples:,} rows ({figure.tokens:,} tokens) prepared, "
                         f"{figure.validation_examples:,} held out; {figure.mixed_examples:,} rows "
                         f"({figure.mixed_tokens:,} tokens, {figure.mixed_examples / max(len(data.train), 1):.1%}) "
                         f"in the mixture, {figure.share_asked:.1%} asked")
        for split, c in (data.counts or {}).items():
            if "pairs" in c:  # preference data: pairs, one a row (runner/components/data/preference.py)
                log.info(f"data: {split}: {c['pairs']:,} pairs ({c['truncated']:,} truncated, {c['dropped']:,} dropped "
                         f"as longer than {block_size} tokens, {c['same_answers_dropped']:,} with equal answers "
                         f"dropped); {c['trained_tokens']:,} of {c['tokens']:,} tokens trained; "
                         + ("packed a micro-batch at a time" if spec.data.packing else "one pair a row, padded per batch"))
                continue
            rows = f"packed into {c['rows']:,} rows of {block_size} (packing efficiency {c['packing_efficiency']:.1%})" \
                if spec.data.packing else f"one a row ({c['rows']:,} rows, padded per batch)"
            log.info(f"data: {split}: {c['examples']:,} examples ({c['truncated']:,} truncated, {c['dropped']:,} dropped "
                     f"as longer than {block_size} tokens), {rows}; {c['trained_tokens']:,} of {c['tokens']:,} tokens "
                     f"trained ({c['trained_share']:.1%})")
            if c.get("no_answer") or c.get("turns_cut"):  # chats: nothing trains after the last answer
                log.info(f"data: {split}: {c['no_answer']:,} chats with no assistant turn left out; "
                         f"{c['turns_cut']:,} cut after their last assistant turn")
    return data


def make_loaders(spec: RunSpec, data: PreparedData | StreamedData, world_size: int) -> Loaders:
    t = spec.train
    pin = torch.cuda.is_available()  # page-locked batches: the non_blocking copy (accelerator.dataloader_config) can overlap
    sampler: EpochSampler | BlockStream
    train_loader: DataLoader
    batches = collate if isinstance(data, StreamedData) else collate_for(spec.data, data.pad_id)
    if isinstance(data, StreamedData):
        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: a warning per loader, nothing to act on
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

        # This rank's own share, not Accelerate's to shard; stateful, so a checkpoint holds
        # its exact position, in its loader workers too.
        sampler = data.train
        train_loader = StatefulDataLoader(
            data.train, batch_size=t.per_device_batch_size, collate_fn=batches, num_workers=t.dataloader_num_workers,
            drop_last=True, generator=loader_generator(t.seed), pin_memory=pin,
        )
    else:
        sampler = EpochSampler(len(data.train), t.seed)  # same order on every rank; Accelerate shards it
        # The epoch's last round completed by fillers, never by duplicates (runner/components/data/epoch_batches.py).
        train_loader = DataLoader(
            WithFillers(data.train), batch_sampler=EpochBatches(sampler, t.per_device_batch_size, world_size),
            collate_fn=masking_fillers(batches), num_workers=t.dataloader_num_workers,
            generator=loader_generator(t.seed),  # never the global stream dropout draws from (runner/train/rng.py)
            pin_memory=pin,
        )
    if (isinstance(data, PreparedData) and data.mixture is not None) or (isinstance(data, StreamedData) and data.sources):
        from runner.components.data.mixture import keeping_sources

        evaluation_batches = keeping_sources(batches)  # each source's loss is reported too
    else:
        evaluation_batches = batches
    evaluation = DataLoader(
        data.validation, batch_size=eval_batch_size(t), shuffle=False,
        collate_fn=evaluation_batches, num_workers=t.dataloader_num_workers, generator=loader_generator(t.seed), pin_memory=pin,
    )
    return Loaders(train_loader, evaluation, sampler)


def data_record(spec: RunSpec, data: PreparedData | StreamedData) -> dict[str, Any]:
    """What a checkpoint's data position indexes, for a resume to check (runner/train/resume.py):
    a stream's files in their order, or the cached blocks' key (tokenizer, block size, the
    files' sha256)."""
    if isinstance(data, StreamedData):
        return {"data_files": training_files(spec.data)}
    return {"data_key": data.cache_path.name}


class Slots(Dataset):
    """train.objective=grpo's training rows: the places of an epoch's completions in the
    run's stream (runner/components/rollouts.py), in order; Accelerate shards them as it
    shards any batches, so a step's B places are the same in every layout."""

    def __init__(self, per_epoch: int) -> None:
        self.per_epoch, self.epoch = per_epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_epoch

    def __getitem__(self, index: int) -> int:
        return self.epoch * self.per_epoch + index


def _slots(places: list[int]) -> dict[str, torch.Tensor]:
    return {"slot": torch.tensor(places, dtype=torch.long)}


def _prompt_indices(indices: list[int]) -> dict[str, torch.Tensor]:
    return {"prompt": torch.tensor(indices, dtype=torch.long)}


def prompt_loaders(spec: RunSpec, slots_per_epoch: int, evaluation_prompts: int) -> Loaders:
    """train.objective=grpo: the slots loader and the evaluation prompts' (their indices)."""
    t = spec.train
    slots = Slots(slots_per_epoch)
    # A loader without its own generator seeds each iterator from the global one, the
    # stream dropout draws from: an epoch's start (or a resume's) would move dropout's masks.
    train = DataLoader(slots, batch_size=t.per_device_batch_size, shuffle=False, collate_fn=_slots,
                       num_workers=t.dataloader_num_workers, generator=loader_generator(t.seed))
    evaluation = DataLoader(range(evaluation_prompts), batch_size=eval_batch_size(t), shuffle=False,  # type: ignore[arg-type]
                            collate_fn=_prompt_indices, num_workers=t.dataloader_num_workers,
                            generator=loader_generator(t.seed))
    return Loaders(train, evaluation, slots)  # type: ignore[arg-type]
