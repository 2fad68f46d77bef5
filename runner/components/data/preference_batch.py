"""A micro-batch of preference pairs, as the objective reads it (runner/components/objectives/dpo.py).

P pairs become 2P sequences: the P chosen answers (each after its prompt), then the P
rejected ones. Labels are -100 on the prompt and the padding. `pair_index` is each
pair's row in its split (the precomputed reference's key). Two layouts:

- padded (`pad_pairs`): one sequence a row, padded on the right to the longest of all
  2P, the attention mask 0 on the padding (TRL's concatenated forward: one forward for
  both halves, so a sharded model gathers its weights once);
- packed (`pack_pairs`, data.packing=true): the 2P sequences first-fit into rows as wide
  as the longest of them, position ids restarting at each sequence and no attention mask
  (transformers' packed-sequence mask keeps them apart, as for packed instruction rows),
  and `sequence_ids` naming each token's sequence (-1: padding). The rows are never more
  nor wider than the padded layout's, so the memory plan's padded trace bounds them.
  Packing happens here, per micro-batch, not when the data is prepared: the pairs a
  micro-batch holds, the step's pair count and the reference table stay those of the
  padded layout, and only the padding goes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from runner.components.data.instruct import pad_batch
from runner.components.data.labels import IGNORE_INDEX

PAIR_INDEX = "pair_index"
SEQUENCE_IDS = "sequence_ids"


def _sequences(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]}
            for side in ("chosen", "rejected") for row in rows]


def _pair_index(rows: Sequence[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([int(row[PAIR_INDEX]) for row in rows])


def pad_pairs(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pair rows as one batch: [chosen_0 .. chosen_{P-1}, rejected_0 .. rejected_{P-1}],
    padded as instruction examples are (instruct.pad_batch)."""
    return {**pad_batch(_sequences(rows), pad_id), PAIR_INDEX: _pair_index(rows)}


def pack_pairs(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pair rows as packed rows (the module's docstring): sequence k of
    [chosen_0 .. chosen_{P-1}, rejected_0 .. rejected_{P-1}] goes into the first row with
    room for it. `real_tokens`: each row's tokens less its padding."""
    both = _sequences(rows)
    sequences = [[int(t) for t in s["input_ids"]] for s in both]
    labels = [[int(t) for t in s["labels"]] for s in both]
    width = max(len(ids) for ids in sequences)
    packed: list[list[int]] = []  # the sequences of each row
    for k, ids in enumerate(sequences):
        row = next((r for r in packed if sum(len(sequences[j]) for j in r) + len(ids) <= width), None)
        if row is None:
            packed.append(row := [])
        row.append(k)
    ids_rows, label_rows, position_rows, owner_rows, real = [], [], [], [], []
    for row in packed:
        ids = [t for k in row for t in sequences[k]]
        pad = width - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        label_rows.append([t for k in row for t in labels[k]] + [IGNORE_INDEX] * pad)
        position_rows.append([p for k in row for p in range(len(sequences[k]))] + list(range(pad)))
        owner_rows.append([k for k in row for _ in sequences[k]] + [-1] * pad)
        real.append(len(ids))
    return {"input_ids": torch.tensor(ids_rows), "labels": torch.tensor(label_rows),
            "position_ids": torch.tensor(position_rows), SEQUENCE_IDS: torch.tensor(owner_rows),
            "real_tokens": torch.tensor(real), PAIR_INDEX: _pair_index(rows)}


def pairs_in(batch: dict[str, Any]) -> int:
    """The batch's pairs (its sequences are twice as many)."""
    if PAIR_INDEX in batch:
        return int(batch[PAIR_INDEX].shape[0])
    return int(batch["input_ids"].shape[0]) // 2


def per_sequence(values: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """[2P]: the sum over each sequence of `values`, given per target position (aligned
    with labels[:, 1:], zero where nothing is trained). Packed rows hold several
    sequences, and a position's target belongs to the sequence of its next token; a
    sequence's first token is a prompt's, never trained, so no sum takes a target across
    two sequences."""
    if SEQUENCE_IDS not in batch:
        return values.sum(dim=1)
    owner = batch[SEQUENCE_IDS][:, 1:].to(values.device)
    sums = torch.zeros(2 * pairs_in(batch), dtype=values.dtype, device=values.device)
    return sums.index_add_(0, owner.clamp(min=0).reshape(-1), (values * (owner >= 0)).reshape(-1))


def answer_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """[2P]: each sequence's trained tokens (its answer, EOS included)."""
    return per_sequence((batch["labels"][:, 1:] != IGNORE_INDEX).long(), batch)
