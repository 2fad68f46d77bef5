"""Prompt data (data.format=prompts, train.objective=grpo): the records as they are, each
a prompt and the columns its rewards read. Nothing is tokenized into blocks or cached:
the rollouts tokenize each prompt once (runner/components/rollouts.py) and generation
makes the training rows. The splits are run_clm's (a validation file or split, else
data.validation_split_percentage held out), limited by data.max_train_samples and
data.max_eval_samples.

A mixture (data.mixture) samples its sources' prompts into one set with datasets'
interleave_datasets, as the other formats' mixtures do (runner/components/data/mixture.py):
each source's prompt field is renamed to data.prompt_field, and the columns every source
has are kept (the rewards read them); the validation prompts are each source's share of
data.max_eval_samples, concatenated."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from runner.components.data.mixture import interleave
from runner.components.data.prepare import PreparedData, cache_key, load_raw
from runner.config.errors import UserError
from runner.config.mixture import evaluation_quota, source_names, source_specs
from runner.config.spec import DataSpec


def _source_splits(data: DataSpec, name: str) -> dict[str, Any]:
    """One source's train and validation prompts, its prompt field checked."""
    raw = load_raw(data)
    for split in ("train", "validation"):
        if data.prompt_field not in raw[split].column_names:
            raise UserError(f"{name}the {split} records have no '{data.prompt_field}' (they have: "
                            f"{', '.join(raw[split].column_names)}). Set data.prompt_field to the field holding the "
                            "prompt.")
    return {split: raw[split] for split in ("train", "validation")}


def _mixed(data: DataSpec) -> dict[str, Any]:
    from datasets import concatenate_datasets

    sources = [_source_splits(source, f"data.mixture: source {name}: ")
               for name, source in zip(source_names(data), source_specs(data))]
    for split_of, source in zip(sources, source_specs(data)):
        for split in split_of:
            if source.prompt_field != data.prompt_field:
                split_of[split] = split_of[split].rename_column(source.prompt_field, data.prompt_field)
    shared = set.intersection(*(set(s["train"].column_names) & set(s["validation"].column_names) for s in sources))
    kept = [{split: rows.select_columns(sorted(shared)) for split, rows in s.items()} for s in sources]
    quota = evaluation_quota([len(s["validation"]) for s in kept], data.max_eval_samples)
    validation = concatenate_datasets([s["validation"].select(range(q)) for s, q in zip(kept, quota)])
    return {"train": interleave([s["train"] for s in kept], data), "validation": validation}


def prepare_prompts(data: DataSpec, tokenizer: Any, block_size: int) -> PreparedData:
    started = time.time()
    if data.mixture:
        splits = _mixed(data)
        limits = {"train": data.max_train_samples, "validation": None}  # the quota has cut the validation
    else:
        splits = _source_splits(data, "")
        limits = {"train": data.max_train_samples, "validation": data.max_eval_samples}
    for split, limit in limits.items():
        if limit is not None:
            splits[split] = splits[split].select(range(min(limit, len(splits[split]))))
    key = hashlib.sha256(cache_key(data, tokenizer, block_size).encode()).hexdigest()[:16]
    return PreparedData(splits["train"], splits["validation"], block_size, Path(f"prompts-{key}"), cache_hit=False,
                        seconds=time.time() - started)
