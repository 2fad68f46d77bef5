"""Prompt data (data.format=prompts, train.objective=grpo): the records as they are, each
a prompt and the columns its rewards read. Nothing is tokenized into blocks or cached:
the rollouts tokenize each prompt once (runner/components/rollouts.py) and generation
makes the training rows. The splits are run_clm's (a validation file or split, else
data.validation_split_percentage held out), limited by data.max_train_samples and
data.max_eval_samples."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from runner.components.data import PreparedData, cache_key, load_raw
from runner.config.errors import UserError
from runner.config.spec import DataSpec


def prepare_prompts(data: DataSpec, tokenizer: Any, block_size: int) -> PreparedData:
    started = time.time()
    raw = load_raw(data)
    splits = {}
    for split, limit in (("train", data.max_train_samples), ("validation", data.max_eval_samples)):
        rows = raw[split]
        if data.prompt_field not in rows.column_names:
            raise UserError(f"the {split} records have no '{data.prompt_field}' (they have: "
                            f"{', '.join(rows.column_names)}). Set data.prompt_field to the field holding the prompt.")
        splits[split] = rows.select(range(min(limit, len(rows)))) if limit is not None else rows
    key = hashlib.sha256(cache_key(data, tokenizer, block_size).encode()).hexdigest()[:16]
    return PreparedData(splits["train"], splits["validation"], block_size, Path(f"prompts-{key}"), cache_hit=False,
                        seconds=time.time() - started)
