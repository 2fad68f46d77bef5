"""data.mixture on the cached path: each source prepared (tokenized, cut, cached) as a
run of that source alone would prepare it, then their training rows sampled into one
dataset by `datasets.interleave_datasets` (probabilities from the weights, the mixture's
seed and stopping rule). What follows is any prepared data's path: the run shuffles
that dataset per epoch with its own seed and shards it over the ranks in global order,
so the mixture trains the same examples in every layout and strategy and resumes at the
same example (runner/components/data/epoch_batches.py). The validation splits are
concatenated, each row keeping its source.

Rows of other layouts are made to share one: among instruction examples, a text block
becomes an example trained on every token (labels the ids; packed, a row of one
sequence with its own position ids), which is what the causal-LM loss trains on it
anyway. Each row carries its source's index (`source`), which the collate functions
leave out of the batch. Preference pairs are renumbered by their place in the mixed
split (`pair_index`), which the precomputed reference's table is indexed by: each source
numbers its own pairs from 0.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from runner.components.data.labels import SOURCE
from runner.components.data.preference_batch import PAIR_INDEX
from runner.config.data_spec import DataFormat, DataSpec
from runner.config.mixture import evaluation_quota, row_format, shares_asked, source_names, source_specs

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass
class SourceFigures:
    """A source's part of the prepared data: what its prepared split held and what the
    mixture took of it."""

    name: str
    share_asked: float
    examples: int  # its prepared training rows
    tokens: int  # their tokens (padding not counted)
    validation_examples: int
    mixed_examples: int = 0  # its rows in the mixture (with all_exhausted, some twice)
    mixed_tokens: int = 0


@dataclass
class Mixture:
    """The mixed training rows' sources and tokens, row by row, and each source's figures."""

    sources: list[int]
    tokens: list[int]
    figures: list[SourceFigures]

    def shares_trained(self, order: Callable[[int], list[int]], rows_trained: Sequence[int]) -> dict[str, list[float]]:
        """The realised shares of examples and of tokens over a run: `rows_trained[e]` rows
        of epoch e's order (`order(e)`: the run's EpochSampler) were trained."""
        count = len(self.figures)
        examples, tokens = [0] * count, [0] * count
        for epoch, rows in enumerate(rows_trained):
            for index in order(epoch)[:rows]:
                examples[self.sources[index]] += 1
                tokens[self.sources[index]] += self.tokens[index]
        total_examples, total_tokens = max(sum(examples), 1), max(sum(tokens), 1)
        return {"examples": [e / total_examples for e in examples], "tokens": [t / total_tokens for t in tokens]}


def row_tokens(rows: "Dataset") -> list[int]:
    """Each row's tokens, padding not counted (packed rows carry their count)."""
    if "real_tokens" in rows.column_names:
        return [int(n) for n in rows["real_tokens"]]
    columns = ["chosen_input_ids", "rejected_input_ids"] if "chosen_input_ids" in rows.column_names else ["input_ids"]
    counted = rows.map(lambda batch: {"_tokens": [sum(len(batch[c][i]) for c in columns)
                                                  for i in range(len(batch[columns[0]]))]},
                       batched=True, remove_columns=rows.column_names, desc="counting tokens")
    return [int(n) for n in counted["_tokens"]]


def mixture_of(train: "Dataset", figures: list[SourceFigures]) -> Mixture:
    """The mixture the run trains on (after data.max_train_samples cut it)."""
    sources, tokens = [int(s) for s in train[SOURCE]], row_tokens(train)
    for figure in figures:
        figure.mixed_examples = figure.mixed_tokens = 0
    for source, count in zip(sources, tokens):
        figures[source].mixed_examples += 1
        figures[source].mixed_tokens += count
    return Mixture(sources, tokens, figures)


def keeping_sources(collate: Callable[[list[Any]], dict[str, Any]]) -> Callable[[list[Any]], dict[str, Any]]:
    """`collate`, with each row's source in the batch (evaluation reports each source's loss)."""
    import torch

    def collate_with_sources(rows: list[Any]) -> dict[str, Any]:
        return {**collate(rows), SOURCE: torch.tensor([int(row[SOURCE]) for row in rows])}

    return collate_with_sources


def as_examples(blocks: "Dataset", packing: bool) -> "Dataset":
    """run_clm's blocks as instruction rows: labels the ids (every token trained, as the
    causal-LM loss trains a block), and packed, a row of one sequence."""

    def convert(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids = batch["input_ids"]
        out: dict[str, list[Any]] = {"labels": [list(row) for row in ids]}
        if packing:
            out["position_ids"] = [list(range(len(row))) for row in ids]
            out["real_tokens"] = [len(row) for row in ids]
        return out

    return blocks.map(convert, batched=True, desc="text blocks as examples")


def interleave(parts: Sequence["Dataset"], data: DataSpec) -> "Dataset":
    """The sources' rows sampled into one dataset: datasets' own interleave_datasets."""
    from datasets import interleave_datasets

    return interleave_datasets(list(parts), probabilities=shares_asked(data), seed=data.mixture_seed,
                               stopping_strategy=data.mixture_stopping.value)


def renumber_pairs(rows: "Dataset") -> "Dataset":
    """Preference rows numbered by their place in `rows` (a pair twice under all_exhausted
    gets two numbers, scored alike); other rows as they are."""
    if PAIR_INDEX not in rows.column_names:
        return rows
    return rows.remove_columns(PAIR_INDEX).add_column(PAIR_INDEX, list(range(len(rows))))


def mixture_key(keys: Sequence[str], data: DataSpec) -> str:
    """What identifies the mixed rows: the sources' cache keys and the sampling's settings."""
    parts = {"sources": list(keys), "weights": [float(s.weight) for s in data.mixture or []],
             "stopping": data.mixture_stopping.value, "seed": data.mixture_seed, "packing": data.packing}
    return "mixture-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Mixed:
    """A mixture ready to train: its rows, their sources, and the name its data goes by."""

    train: "Dataset"
    validation: "Dataset"
    mixture: Mixture
    key: str  # the sources' cache keys and the sampling's settings, digested (mixture_key)


def mix(data: DataSpec, prepare_source: Callable[[DataSpec], Any]) -> Mixed:
    """Each source prepared by `prepare_source` (components.data.prepare.prepare of one source),
    made to share the mixture's row layout, tagged and interleaved; then cut by
    data.max_train_samples (the mixture) and max_eval_samples (shared among the sources)."""
    from datasets import concatenate_datasets

    specs, names, asked = source_specs(data), source_names(data), shares_asked(data)
    layout = row_format(data)
    prepared = [prepare_source(spec) for spec in specs]
    trains, validations, figures = [], [], []
    for index, (spec, ready) in enumerate(zip(specs, prepared)):
        train, validation = ready.train.with_format(None), ready.validation.with_format(None)
        if spec.format is DataFormat.text and layout is not DataFormat.text:
            train, validation = as_examples(train, data.packing), as_examples(validation, data.packing)
        trains.append(train.add_column(SOURCE, [index] * len(train)))
        validations.append(validation.add_column(SOURCE, [index] * len(validation)))
        figures.append(SourceFigures(names[index], asked[index], len(train), sum(row_tokens(train)), len(validation)))
    # A text block's ids are stored as another integer type than an example's: one schema.
    features = next((t.features for t, spec in zip(trains, specs) if spec.format is not DataFormat.text),
                    trains[0].features)
    trains = [t.cast(features) if t.features != features else t for t in trains]
    validations = [v.cast(features) if v.features != features else v for v in validations]
    if data.max_eval_samples is not None:
        quota = evaluation_quota([len(v) for v in validations], data.max_eval_samples)
        validations = [v.select(range(n)) for v, n in zip(validations, quota)]
    train, validation = interleave(trains, data), concatenate_datasets(validations)
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    train, validation = renumber_pairs(train), renumber_pairs(validation)
    return Mixed(train, validation, mixture_of(train, figures), mixture_key([r.cache_path.name for r in prepared], data))
