"""The run spec's data section (`data.*`): where the training text comes from, how it is
tokenized and cut, and how instruction and preference records are read.

Part of the schema in runner.config.spec, which nests `DataSpec` as `RunSpec.data` and
re-exports these names; apart because the data settings are the schema's largest
section and grow with each data format. Every field is documented under it, as in spec.py
(docs/configuration.md is generated from both).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class DataFormat(str, enum.Enum):
    text = "text"  # run_clm: raw text, concatenated and cut into blocks
    prompt_completion = "prompt_completion"  # two fields per record; loss on the completion
    chat = "chat"  # a list of {role, content} messages; loss on the assistant turns
    preference = "preference"  # a prompt, a chosen and a rejected answer (train.objective=dpo)
    prompts = "prompts"  # a prompt (text or messages) and the columns its rewards read (train.objective=grpo)


class TooLong(str, enum.Enum):
    truncate = "truncate"
    drop = "drop"


class MixtureStop(str, enum.Enum):
    """When a mixture's sampling stops (datasets.interleave_datasets' stopping_strategy)."""

    first_exhausted = "first_exhausted"  # when the first source runs out: no example repeats
    all_exhausted = "all_exhausted"  # when the last runs out: the others start again (oversampled)


@dataclass
class MixtureSource:
    """One source of data.mixture: where its records come from and how they are read. A
    setting left null is the run's own data.* setting (block size, packing, too_long,
    train_on_prompt and the cache are always the run's)."""

    weight: float = 1.0
    """Its share of the sampled examples, relative to the other sources' weights (the
    probabilities are the weights over their sum)."""
    name: Optional[str] = None
    """A label for the reports. null: the dataset's name or the train file's name."""
    dataset_name: Optional[str] = None
    dataset_config_name: Optional[str] = None
    train_split: Optional[str] = None
    validation_split: Optional[str] = None
    train_file: Optional[str] = None
    validation_file: Optional[str] = None
    text_column: Optional[str] = None
    format: Optional[DataFormat] = None
    prompt_field: Optional[str] = None
    completion_field: Optional[str] = None
    messages_field: Optional[str] = None
    chosen_field: Optional[str] = None
    rejected_field: Optional[str] = None
    chat_template: Optional[str] = None


@dataclass
class DataSpec:
    dataset_name: Optional[str] = None
    """A hub dataset (`wikitext`). Set either this or `train_file`."""
    dataset_config_name: Optional[str] = None
    """The hub dataset's configuration (`wikitext-2-raw-v1`)."""
    train_split: str = "train"
    """The hub dataset's split to train on (HuggingFaceH4/ultrafeedback_binarized: `train_prefs`)."""
    validation_split: Optional[str] = None
    """The hub dataset's split to evaluate on (`test_prefs`). null: its `validation` split
    if it has one, else `validation_split_percentage` of the training split held out."""
    train_file: Optional[str] = None
    """A local .txt, .json, .jsonl or .csv file, optionally gzipped (.gz). With
    data.streaming=true also .parquet, other compressions, and globs."""
    validation_file: Optional[str] = None
    """Like `train_file`. null: hold out `validation_split_percentage` of train."""
    validation_split_percentage: int = 5
    """Percent of train used for validation when there is no validation split (1-99)."""
    text_column: Optional[str] = None
    """Column holding the text. null: `text` if present, else the first column. data.format=text
    only (instruction records name their fields: prompt_field, completion_field, messages_field)."""
    keep_linebreaks: bool = True
    """For .txt files: keep the newline at the end of each line. data.format=text only."""
    block_size: Optional[int] = None
    """Tokens per training sequence. null: min(1024, the model's max positions)."""
    max_train_samples: Optional[int] = None
    """Keep only the first N training blocks (debugging, quick runs)."""
    max_eval_samples: Optional[int] = None
    """Keep only the first N evaluation blocks. A mixture shares them evenly among its
    sources, each its first rows, so that every source is evaluated."""
    preprocessing_num_workers: Optional[int] = None
    """Processes for tokenization. null: one. The blocks depend on it (each worker groups
    its own contiguous shard), so it is part of the data cache key, and a resume refuses
    a change of it. Instruction formats tokenize their records on as many (each record is
    its own example: the rows are the same whatever the number)."""
    cache_dir: Optional[str] = None
    """Where tokenized, grouped data is cached. null: $RUNNER_CACHE_DIR or ~/.cache/runner."""
    streaming: bool = False
    """Read the data as a stream (datasets' streaming API): tokenized and grouped on the
    fly, nothing cached, memory flat whatever the corpus size; each rank reads its own
    share. Files may be .txt, .json, .jsonl, .csv or .parquet, compressed (.gz, .bz2, .xz,
    .zst) or not, and train_file / validation_file may be globs ('/data/*.jsonl.gz').
    The length is unknown, so train.max_steps is required. See docs/data.md."""
    shuffle_buffer: int = 1000
    """Streaming: blocks per shuffle window. Each window is permuted with a seed from
    (train.seed, epoch, window); 0 or 1: stream order. Larger mixes more and costs
    memory (a window of blocks) and, on resume, re-reading at most one window."""
    validation_blocks: Optional[int] = None
    """Streaming: evaluation blocks, read once and kept in memory (the same blocks at
    every evaluation). With a validation file or split: its first N blocks (null: all of
    it). Without one: the first N blocks of the training stream are held out from
    training (null: 100)."""
    format: DataFormat = DataFormat.text
    """text: run_clm's path (the default). prompt_completion: .json/.jsonl records with a
    prompt and a completion; chat: records with a list of {role, content} messages. Both
    train on the answer only and keep each example whole (docs/instruction-data.md)."""
    prompt_field: str = "prompt"
    """prompt_completion: the record's prompt field."""
    completion_field: str = "completion"
    """prompt_completion: the record's completion field."""
    messages_field: str = "messages"
    """chat: the record's list of messages."""
    chosen_field: str = "chosen"
    """preference: the record's preferred answer (text, or the assistant's messages)."""
    rejected_field: str = "rejected"
    """preference: the record's dispreferred answer (text, or the assistant's messages)."""
    chat_template: Optional[str] = None
    """chat: a Jinja chat template, as a file path or the template itself. null: the
    tokenizer's own (GPT-2's has none: ${asset:chat_template_plain.jinja} is a plain one).
    A value that names no file and holds no {{ or {% is refused, as is a template that
    does not parse. {% generation %} blocks, where the template has them, mark the answers."""
    train_on_prompt: bool = False
    """Instruction formats: also train on the prompt and the user and system turns."""
    too_long: TooLong = TooLong.truncate
    """Instruction formats: an example longer than block_size is truncated (the answer kept
    where it fits) or dropped; the counts are reported."""
    packing: bool = False
    """Instruction formats: whole examples packed into rows of block_size, position ids
    restarting and attention kept within each example. false: one example a row, padded
    to the longest in its batch."""
    mixture: Optional[list[MixtureSource]] = None
    """Several sources trained together in proportions (docs/data.md, Mixtures): each its
    own dataset or files, format, fields and `weight`. The training examples are sampled
    from the sources as datasets.interleave_datasets samples them (probabilities from the
    weights, `mixture_seed`, `mixture_stopping`), once, before training; the run then
    shuffles and shards that mixture as any prepared data. The validation splits are
    concatenated. null: one source, the data.* settings above."""
    mixture_stopping: MixtureStop = MixtureStop.first_exhausted
    """first_exhausted: stop sampling when a source runs out (no example twice);
    all_exhausted: when every source has been seen whole (the smaller ones repeat)."""
    mixture_seed: int = 42
    """The seed of the mixture's sampling (interleave_datasets' seed)."""
