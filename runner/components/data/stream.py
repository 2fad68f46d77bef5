"""Streaming data (data.streaming=true): blocks tokenized and grouped on the fly.

The files (or a hub dataset) are read through `datasets`' streaming API, tokenized and
cut into blocks by the same `group_texts` as the cached path (runner/components/data/prepare.py),
in the same batches of 1,000 rows, so with shuffling off a stream yields the cached
path's blocks in the cached path's order. Nothing is written to disk and memory stays
flat whatever the corpus size.

Each rank reads its own share (`split_dataset_by_node`: whole files when the file count
divides by the world size, else every world-th block). `BlockStream` adds what
`datasets` lacks for exact resume: its shuffle buffer's contents are not saved (a resume
refills it, so the order changes). Here the buffer is a window of `shuffle_buffer`
blocks permuted by a seed of (run seed, epoch, window number); its state is the
library's own position at the window's start plus how many of the window's blocks were
handed out. A resume restores that position through the iterable's `load_state_dict`,
re-reads at most one window, and continues at the exact next block.

A mixture (data.mixture) streams too: each source's blocks (and its held-out head) as a
stream of it alone would read them, tagged with the source's index, sampled into one
stream by `datasets.interleave_datasets` (the weights' probabilities, the mixture's seed
and stopping rule), whose position the library saves and restores as it does a file's.
Every rank reads the mixed stream and keeps every world-th block; `BlockStream` counts
the blocks it hands out per source, in its state, for the realised shares.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from datasets import Dataset, IterableDataset, interleave_datasets, load_dataset
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from runner.components.data.checks import check_file
from runner.components.data.epoch_batches import epoch_order_seed
from runner.components.data.labels import SOURCE
from runner.components.data.prepare import check_splits, group_texts, text_column_of
from runner.config.errors import UserError
from runner.config.mixture import evaluation_quota, shares_asked, source_names, source_specs
from runner.config.spec import DataSpec

log = logging.getLogger(__name__)

# file type (after compression suffixes) -> datasets builder
STREAM_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Compressions datasets' streaming opens on the fly (fsspec infers them from the suffix).
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# Validation blocks held out from the head of the training stream when there is no
# validation file or split and data.validation_blocks is null.
DEFAULT_HELD_OUT_BLOCKS = 100


class BadRecord(RuntimeError):
    """A record the stream could not read or tokenize, named by file and record.

    Built from one line; a DataLoader worker re-raises it in the training process with
    its own traceback text around that line, which `line` recovers."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        last = [ln for ln in str(text).strip().splitlines() if ln.strip()][-1:] or [str(text)]
        self.line = last[0].split("BadRecord: ", 1)[-1].strip()


def file_type(path: str) -> str:
    """'.jsonl' for 'x.jsonl.gz'; '' when the type is not one streaming reads."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in COMPRESSIONS:
        suffix = Path(p.stem).suffix.lower()
    return suffix if suffix in STREAM_BUILDERS else ""


def expand_files(pattern: str, override: str) -> list[str]:
    """A file, or a glob (`data/*.jsonl.gz`, `shards/**/*.parquet`), as sorted paths."""
    expanded = os.path.expanduser(pattern)
    files = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
    files = [f for f in files if not os.path.isdir(f)]
    if not files or not all(os.path.exists(f) for f in files):
        raise UserError(f"{override}={pattern}: no such file{' matches the pattern' if glob.has_magic(expanded) else ''}. "
                        f"Fix the path ({override}=/path/to/train.txt, or a glob such as '/data/*.jsonl.gz').")
    return files


def check_stream_files(pattern: str, override: str) -> list[str]:
    """Problems with a streamed file pattern, found without reading the files through:
    they exist, are of a type the stream reads, and are all of one type."""
    try:
        files = expand_files(pattern, override)
    except UserError as err:
        return err.problems
    kinds = {file_type(f) for f in files}
    if "" in kinds:
        bad = next(f for f in files if not file_type(f))
        return [f"{override}: '{Path(bad).name}' has a type streaming cannot read; use "
                f"{', '.join(STREAM_BUILDERS)} (optionally compressed: {', '.join(COMPRESSIONS)})."]
    if len({STREAM_BUILDERS[k] for k in kinds}) > 1:
        return [f"{override}={pattern}: the files mix types ({', '.join(sorted(kinds))}); a stream reads one type. "
                "Narrow the pattern to one."]
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        return [f"{override}: '{empty[0]}' is empty. Give files with text in them."]
    return []


def training_files(data: DataSpec) -> list[list[Any]]:
    """The training files a stream reads, in shard order, as [real path, bytes]: what a
    checkpoint's position indexes (datasets counts files by their place in this list).
    Empty for a hub dataset, whose files the hub versions; a mixture's sources' in turn."""
    if data.mixture:
        return [entry for source in source_specs(data) for entry in training_files(source)]
    if data.dataset_name or not data.train_file:
        return []
    return [[os.path.realpath(f), os.path.getsize(f)] for f in expand_files(str(data.train_file), "data.train_file")]


def training_files_changes(saved: list[list[Any]], now: list[list[Any]]) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between the files a checkpoint's position indexes
    and today's. Another list or order moves the position to other files; a file whose
    size changed keeps its place (a record fixed after a bad-record stop, say)."""
    before, after = [name for name, _ in saved], [name for name, _ in now]
    if before != after:
        added = [n for n in after if n not in before]
        removed = [n for n in before if n not in after]
        what = "; ".join(filter(None, [f"added {', '.join(added)}" if added else "",
                                       f"removed {', '.join(removed)}" if removed else "",
                                       "" if added or removed else "the same files in another order"]))
        return [f"data.train_file: the files it expands to changed since the checkpoint ({what}); the stream's position "
                "counts files by their place in the list, so it would continue in other files. Restore the files as "
                "they were, or start a new run folder"], []
    resized = [f"{name} ({a:,} -> {b:,} bytes)" for (name, a), (_, b) in zip(saved, now) if a != b]
    if not resized:
        return [], []
    return [], [f"data.train_file: {', '.join(resized)} changed size since the checkpoint; the position counts records "
                "within each file, so an edit before it in the file being read shifts it"]


@dataclass
class Source:
    """What one stream reads: local files of one type, or one split of a hub dataset."""

    files: list[str]
    builder: str = ""
    dataset: Optional[tuple[str, Optional[str], str]] = None  # (name, config, split)

    def describe(self) -> str:
        if self.dataset:
            name, config, split = self.dataset
            return f"{name}{'/' + config if config else ''} [{split}], streamed"
        return f"{len(self.files)} file(s) streamed ({self.files[0]}{', ...' if len(self.files) > 1 else ''})"

    def open(self, data: DataSpec) -> IterableDataset:
        if self.dataset:
            name, config, split = self.dataset
            return load_dataset(name, config, split=split, streaming=True)
        kwargs = {"keep_linebreaks": data.keep_linebreaks} if self.builder == "text" else {}
        return load_dataset(self.builder, data_files={"train": self.files}, split="train", streaming=True, **kwargs)


def sources(data: DataSpec) -> tuple[Source, Optional[Source]]:
    """The training source and the validation one (None: held out from training's head)."""
    if data.dataset_name:
        from datasets import get_dataset_split_names

        splits = get_dataset_split_names(data.dataset_name, data.dataset_config_name)
        check_splits(data, list(splits))
        validation = data.validation_split or next((s for s in ("validation", "valid", "test") if s in splits), None)
        train = Source([], dataset=(data.dataset_name, data.dataset_config_name, data.train_split))
        held = Source([], dataset=(data.dataset_name, data.dataset_config_name, validation)) if validation else None
        return train, held
    files = expand_files(str(data.train_file), "data.train_file")
    train = Source(files, STREAM_BUILDERS[file_type(files[0])])
    if not data.validation_file:
        return train, None
    vfiles = expand_files(data.validation_file, "data.validation_file")
    return train, Source(vfiles, STREAM_BUILDERS[file_type(vfiles[0])])


def to_blocks(raw: IterableDataset, data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int) -> IterableDataset:
    """Tokenize and group on the fly, as the cached path does (same batches of rows)."""
    columns = raw.column_names
    if columns is None:  # json without declared features: the first record names them
        columns = list(next(iter(raw)).keys())  # open_stream names a bad first record
    column = text_column_of(data, columns)
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)  # long rows are split next
    # datasets logs its reader's error before raising it; BadRecord names the record instead, once
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        return {"input_ids": tokenizer(batch[column], return_attention_mask=False)["input_ids"]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=columns)
    return tokenized.map(group_texts, batched=True, fn_kwargs={"block_size": block_size})


def _innermost(state: Any) -> dict[str, Any]:
    """The file-level position (shard index, rows read) inside a datasets state dict."""
    while isinstance(state, dict) and "examples_iterable" in state:
        state = state["examples_iterable"]
    return state if isinstance(state, dict) else {}


class BlockStream(torch.utils.data.IterableDataset):
    """One rank's training blocks, shuffled in seeded windows, with an exact position.

    `state_dict()` is the position after the last block handed out; a DataLoader, or
    torchdata's StatefulDataLoader in each loader worker, saves and restores it."""

    def __init__(self, blocks: IterableDataset, files: list[str], shuffle_buffer: int, seed: int,
                 limit: Optional[int] = None, step: tuple[int, int] = (0, 1), sources: int = 0) -> None:
        self.pristine = blocks  # never iterated: each pass starts from a copy (load_state_dict sticks to an iterable)
        self.files = files  # this rank's files, in shard order, to name a bad record's file
        self.window = max(1, shuffle_buffer)
        self.shuffle = shuffle_buffer > 1
        self.seed = seed
        self.limit = limit  # data.max_train_samples: this rank's blocks per pass
        # (rank, world): keep every world-th block of a stream every rank reads whole (see open_stream)
        self.offset, self.stride = step
        self.epoch = 0
        # a mixture's blocks handed out per source, over every pass (kept in the state)
        self.counts = [0] * sources
        self._state: Optional[dict[str, Any]] = None
        self._resume: Optional[dict[str, Any]] = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state) if self._state else self._position(None, 0, 0, 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.counts = list(state.get("sources", self.counts))
        self._resume = state if state.get("start") is not None else None

    def _position(self, start: Optional[dict[str, Any]], window: int, index: int, taken: int) -> dict[str, Any]:
        """The state after `index` blocks of window `window`, which starts at the library's
        position `start` (None: no block read yet) after `taken` blocks of this pass."""
        return {"epoch": self.epoch, "start": start, "window": window, "index": index, "taken": taken,
                "sources": list(self.counts)}

    def _order(self, window: int, n: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        rng = np.random.default_rng([epoch_order_seed(self.seed, self.epoch), window])
        return rng.permutation(n).tolist()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = copy.deepcopy(self.pristine)
        resume, self._resume = self._resume, None
        window, index, taken = 0, 0, 0
        if resume is not None:
            stream.load_state_dict(resume["start"])
            window, index, taken = int(resume["window"]), int(resume["index"]), int(resume["taken"])
        rows = iter(stream)
        if self.stride > 1:
            # A restored position sits right after this rank's last row (`taken` > 0), or at
            # the pass's start (none taken yet): other ranks' rows to pass over before this
            # rank's next one are then `stride - 1`, or this rank's `offset`.
            rows = islice(rows, self.offset if taken == 0 else self.stride - 1, None, self.stride)
        while self.limit is None or taken < self.limit:
            start = stream.state_dict()
            want = self.window if self.limit is None else min(self.window, self.limit - taken)
            blocks = self._read(stream, rows, want)
            if not blocks:
                return
            order = self._order(window, len(blocks))
            for k in range(index, len(blocks)):
                block = blocks[order[k]]
                if self.counts:
                    self.counts[int(block[SOURCE])] += 1
                self._state = self._position(start, window, k + 1, taken)
                yield {"input_ids": torch.tensor(block["input_ids"], dtype=torch.long)}
            # the window is spent: the next one starts after it
            window, index, taken = window + 1, 0, taken + len(blocks)
            self._state = self._position(stream.state_dict(), window, 0, taken)

    def _read(self, stream: IterableDataset, rows: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        try:
            return list(islice(rows, n))
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - anything the reader or tokenizer raises on one record
            raise BadRecord(self.locate(stream, err)) from None

    def locate(self, stream: IterableDataset, err: Exception) -> str:
        files = self.files
        worker = torch.utils.data.get_worker_info()
        if worker is not None and len(files) > 1:  # datasets gives each loader worker every n-th file
            files = files[worker.id :: worker.num_workers] or files
        return name_bad_record(files, _innermost(stream.state_dict()), err, "the training stream")


def name_bad_record(files: list[str], position: dict[str, Any], err: Exception, what: str) -> str:
    """One line naming a bad record's file and record: the file from the stream's position,
    the record by checking that file line by line (the library's own message counts rows
    within the chunk it read, and names no line)."""
    shard = int(position.get("shard_idx", 0))
    candidates = files[shard:] + files[:shard] if shard < len(files) else files
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    for path in candidates[:3]:  # the file at the position, then its neighbours
        problems = check_file(path, "data", None) if file_type(path) in (".txt", ".json", ".jsonl", ".csv") else []
        if problems:
            return f"bad record in {what}: {problems[0].split(': ', 1)[-1]}"
    where = candidates[0] if candidates else "the stream"
    return (f"bad record in {what}: {where}, after record {position.get('shard_example_idx', '?')} "
            f"of that file: {type(err).__name__}: {reason}. Fix or remove that record.")


@dataclass
class StreamedData:
    """What the worker trains on when data.streaming=true."""

    train: BlockStream
    validation: "Dataset"  # the same blocks at every evaluation, held in memory
    block_size: int
    source: str
    seconds: float
    sources: tuple[str, ...] = ()  # a mixture's sources, in the order the blocks' `source` indexes them


def held_out_blocks(data: DataSpec, validation: Optional[Source]) -> Optional[int]:
    """Validation blocks: data.validation_blocks, or with no validation source the default held out."""
    if data.validation_blocks is not None:
        return data.validation_blocks
    return None if validation is not None else DEFAULT_HELD_OUT_BLOCKS


def source_blocks(data: DataSpec, tokenizer: "PreTrainedTokenizerBase",
                  block_size: int) -> tuple[IterableDataset, list[dict[str, Any]], Source, Optional[Source]]:
    """One source's training blocks and its evaluation blocks, read now (held out from the
    training stream's head when there is no validation file or split)."""
    train_source, validation_source = sources(data)
    with named_bad_records(train_source, "the training stream"):
        train_blocks = to_blocks(train_source.open(data), data, tokenizer, block_size)
    n_eval = held_out_blocks(data, validation_source)
    if validation_source is None:
        with named_bad_records(train_source, "the training stream"):
            head = list(islice(train_blocks, n_eval))
        train_blocks = train_blocks.skip(n_eval)
    else:
        with named_bad_records(validation_source, "the validation stream"):
            validation_blocks = to_blocks(validation_source.open(data), data, tokenizer, block_size)
            head = list(validation_blocks if n_eval is None else islice(validation_blocks, n_eval))
    return train_blocks, head, train_source, validation_source


def open_stream(data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int, seed: int,
                rank: int = 0, world_size: int = 1) -> StreamedData:
    """This rank's training stream and the evaluation blocks (read now, kept in memory)."""
    started = time.perf_counter()
    if data.mixture:
        return open_mixed_stream(data, tokenizer, block_size, seed, rank, world_size, started)
    train_blocks, head, train_source, validation_source = source_blocks(data, tokenizer, block_size)
    head = evaluation_head(data, head, block_size)
    files, step = train_source.files, (0, 1)
    limit = None if data.max_train_samples is None else max(1, data.max_train_samples // world_size)
    if world_size > 1:
        by_files = train_blocks.n_shards % world_size == 0
        if by_files and validation_source is None:
            # datasets splits a skip over the files (each rank skips part of it), so the
            # held-out head would leak into rank 0's training blocks: every rank reads the
            # whole stream instead and keeps every world-th block, as datasets does when
            # the files do not divide.
            step = (rank, world_size)
        else:
            if by_files:  # whole files per rank (datasets' rule): name this rank's
                files = files[rank::world_size]
            train_blocks = split_dataset_by_node(train_blocks, rank=rank, world_size=world_size)
    stream = BlockStream(train_blocks, files, data.shuffle_buffer, seed, limit=limit, step=step)
    validation = Dataset.from_dict({"input_ids": [row["input_ids"] for row in head]}).with_format("torch")
    return StreamedData(stream, validation, block_size, train_source.describe(), time.perf_counter() - started)


def evaluation_head(data: DataSpec, head: list[dict[str, Any]], block_size: int) -> list[dict[str, Any]]:
    """The evaluation blocks, cut to data.max_eval_samples; none is refused."""
    if data.max_eval_samples is not None:
        head = head[: data.max_eval_samples]
    if not head:
        where = data.validation_file or "the validation split"
        raise UserError(f"the validation data ({where}) is shorter than one block of {block_size} tokens. Give a longer "
                        "data.validation_file, or lower data.block_size.")
    return head


def open_mixed_stream(data: DataSpec, tokenizer: "PreTrainedTokenizerBase", block_size: int, seed: int,
                      rank: int, world_size: int, started: float) -> StreamedData:
    """A mixture's stream: each source's blocks tagged with its index and sampled into one
    by `datasets.interleave_datasets` (a source of weight 0 is evaluated, never trained);
    every rank reads the mixed stream and keeps every world-th block. The evaluation
    blocks are each source's, in the sources' order, each with its index; max_eval_samples
    is shared among the sources (evaluation_quota)."""
    names, shares = source_names(data), shares_asked(data)
    trained, heads, files, described = [], [], [], []
    for index, (name, source) in enumerate(zip(names, source_specs(data))):
        blocks, head, train_source, _ = source_blocks(source, tokenizer, block_size)
        heads.append([{"input_ids": row["input_ids"], SOURCE: index} for row in head])
        described.append(f"{name} ({shares[index]:.0%}): {train_source.describe()}")
        if shares[index] > 0:
            trained.append(blocks.map(lambda batch, i=index: {SOURCE: [i] * len(batch["input_ids"])}, batched=True))
            files += train_source.files
    mixed = interleave_datasets(trained, probabilities=[share for share in shares if share > 0], seed=data.mixture_seed,
                                stopping_strategy=data.mixture_stopping.value)
    quota = evaluation_quota([len(h) for h in heads], data.max_eval_samples)
    head = evaluation_head(data, [row for h, n in zip(heads, quota) for row in h[:n]], block_size)
    limit = None if data.max_train_samples is None else max(1, data.max_train_samples // world_size)
    stream = BlockStream(mixed, files, data.shuffle_buffer, seed, limit=limit,
                         step=(rank, world_size) if world_size > 1 else (0, 1), sources=len(names))
    validation = Dataset.from_dict({"input_ids": [row["input_ids"] for row in head],
                                    SOURCE: [row[SOURCE] for row in head]}).with_format("torch")
    return StreamedData(stream, validation, block_size, "a mixture of " + "; ".join(described),
                        time.perf_counter() - started, sources=tuple(names))


def blocks_handed_out(state: Any) -> list[int]:
    """A mixture's blocks per source in a stream's saved state (the loader's: a BlockStream
    state, or one per loader worker), summed."""
    if isinstance(state, dict):
        if "sources" in state and "epoch" in state:
            return list(state["sources"])
        parts = [blocks_handed_out(value) for value in state.values()]
    elif isinstance(state, (list, tuple)):
        parts = [blocks_handed_out(value) for value in state]
    else:
        return []
    parts = [part for part in parts if part]
    return [sum(column) for column in zip(*parts)] if parts else []


def first_step(streamed: StreamedData, data: DataSpec, per_step: int, rank: int = 0, world_size: int = 1) -> None:
    """Refuse a rank's training stream that cannot give one optimizer step (`per_step`
    blocks: micro-batch x accumulation), reading that many blocks and no more: the
    trainer would otherwise find every pass empty."""
    n = len(list(islice(iter(streamed.train), per_step)))
    if n == per_step:
        return
    who = f"rank {rank} of {world_size}'s share of " if world_size > 1 else ""
    if not n:
        raise UserError(f"{who}the training data ({streamed.source}) holds no block of {streamed.block_size} tokens after "
                        "the held-out evaluation blocks. Give more text, lower data.block_size or data.validation_blocks.")
    capped = data.max_train_samples is not None and streamed.train.limit == n
    cause = (f"data.max_train_samples={data.max_train_samples} leaves {who}the stream {n} block(s) a pass"
             if capped else f"{who}the training data ({streamed.source}) holds {n} block(s) of {streamed.block_size} tokens")
    fix = (f"raise data.max_train_samples to at least {per_step * world_size}" if capped
           else "give more text, lower data.block_size")
    raise UserError(f"{cause}, fewer than one optimizer step of {per_step} (per-device batch x accumulation). "
                    f"{fix[0].upper() + fix[1:]}, or lower train.per_device_batch_size or train.grad_accum_steps.")


@contextmanager
def named_bad_records(source: Source, what: str) -> Iterator[None]:
    """A record the reader or tokenizer fails on, while opening a stream, as BadRecord."""
    try:
        yield
    except (UserError, BadRecord):
        raise
    except Exception as err:  # noqa: BLE001 - anything the reader or tokenizer raises on one record
        if not source.files:  # a hub dataset: no file to name
            raise BadRecord(f"bad record in {what} ({source.describe()}): {type(err).__name__}: {err}") from None
        raise BadRecord(name_bad_record(source.files, {}, err, what)) from None
