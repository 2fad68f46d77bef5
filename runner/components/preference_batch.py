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

from runner.components.instruct import pad_batch

PAIR_INDEX = "pair_index"


def pad_pairs(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pair rows as one batch: [chosen_0 .. chosen_{P-1}, rejected_0 .. rejected_{P-1}],
    padded as instruction examples are (instruct.pad_batch)."""
    sequences = [{"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]}
                 for side in ("chosen", "rejected") for row in rows]
    return {**pad_batch(sequences, pad_id), PAIR_INDEX: torch.tensor([int(row[PAIR_INDEX]) for row in rows])}


def pairs_in(batch: dict[str, Any]) -> int:
    """The batch's pairs (its sequences are twice as many)."""
    return int(batch["input_ids"].shape[0]) // 2
