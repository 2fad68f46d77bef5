"""Items of the austen_next task, read from the file beside this one (built and
sha-pinned by scripts/build_assets.py), so the task needs no network and no path
relative to where lm-eval was started."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

ITEMS = Path(__file__).with_name("austen_next.jsonl.gz")


def load(**metadata: Any) -> Any:
    """lm-eval's custom_dataset: a DatasetDict with the one split the task reads."""
    import datasets

    with gzip.open(ITEMS, "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})
