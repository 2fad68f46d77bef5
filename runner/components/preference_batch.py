"""A micro-batch of preference pairs, as the objective reads it (runner/components/objectives/dpo.py).

P pairs become 2P sequences: the P chosen answers (each after its prompt), then the P
rejected ones, padded on the right to the longest of all 2P (TRL's concatenated forward:
one forward for both halves, so a sharded model gathers its weights once). Labels are
-100 on the prompt and the padding; the attention mask is 0 on the padding. `pair_index`
is each pair's row in its split (the precomputed reference's key).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from runner.components.labels import IGNORE_INDEX

PAIR_INDEX = "pair_index"


def pad_pairs(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pair rows as one batch: [chosen_0 .. chosen_{P-1}, rejected_0 .. rejected_{P-1}]."""
    sequences = [(row[f"{side}_input_ids"], row[f"{side}_labels"]) for side in ("chosen", "rejected") for row in rows]
    longest = max(len(ids) for ids, _ in sequences)

    def padded(values: Any, fill: int) -> list[int]:
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        return values + [fill] * (longest - len(values))

    return {
        "input_ids": torch.tensor([padded(ids, pad_id) for ids, _ in sequences]),
        "labels": torch.tensor([padded(labels, IGNORE_INDEX) for _, labels in sequences]),
        "attention_mask": torch.tensor([padded([1] * len(ids), 0) for ids, _ in sequences]),
        PAIR_INDEX: torch.tensor([int(row[PAIR_INDEX]) for row in rows]),
    }


def pairs_in(batch: dict[str, Any]) -> int:
    """The batch's pairs (its sequences are twice as many)."""
    return int(batch["input_ids"].shape[0]) // 2
