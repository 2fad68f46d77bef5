"""Pairs as one batch (runner/components/data/preference_batch.py), and an epoch's fillers among them."""

from __future__ import annotations

import torch

from runner.components.data.epoch_batches import Filler, masking_fillers
from runner.components.data.labels import IGNORE_INDEX
from runner.components.data.preference_batch import pad_pairs, pairs_in


def pair(prompt: list[int], chosen: list[int], rejected: list[int], index: int) -> dict:
    def side(answer: list[int]) -> tuple[list[int], list[int]]:
        return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer

    (ci, cl), (ri, rl) = side(chosen), side(rejected)
    return {"chosen_input_ids": ci, "chosen_labels": cl, "rejected_input_ids": ri, "rejected_labels": rl,
            "pair_index": index}


def test_pairs_are_the_chosen_then_the_rejected_padded_to_the_longest():
    rows = [pair([1, 2], [3], [4, 5, 6], 0), pair([7], [8, 9], [10], 5)]
    batch = pad_pairs(rows, pad_id=0)
    assert pairs_in(batch) == 2 and batch["input_ids"].shape == (4, 5)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [7, 8, 9, 0, 0], [1, 2, 4, 5, 6], [7, 10, 0, 0, 0]]
    assert batch["labels"][1].tolist() == [IGNORE_INDEX, 8, 9, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 3, 5, 2]
    assert batch["pair_index"].tolist() == [0, 5]


def test_a_filler_pair_trains_neither_answer_and_counts_no_token():
    """The epoch's last batch completed by a filler (a copy of row 0): both its sequences,
    the chosen in the first half and the rejected in the second, are masked."""
    rows = [pair([1, 2], [3], [4, 5], 0), pair([7], [8, 9], [10], 1)]
    batch = masking_fillers(lambda r: pad_pairs(r, pad_id=0))([rows[1], Filler(rows[0])])
    trained = (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
    assert trained == [2, 0, 1, 0]  # chosen of pair 1, filler's chosen, rejected of pair 1, filler's rejected
    assert batch["real_tokens"].tolist() == [3, 0, 2, 0]
