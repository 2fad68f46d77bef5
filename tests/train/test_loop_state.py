"""The loop's figures over a log window: a mean of the steps, each the mean of its
micro-batches, except a `.../max` figure, the largest of them all, resumed in another
layout as the largest any rank had."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runner.train.loop_state import LoopState, add_micro_batch, close_step, restore_loop_state

pytestmark = pytest.mark.unit


def step(state: LoopState, values: list[float]) -> None:
    for value in values:
        add_micro_batch(state, torch.tensor(value), {"kl": torch.tensor(value), "gap/max": torch.tensor(value)})
    close_step(state)


def test_a_max_figure_is_the_largest_of_the_windows_micro_batches_and_the_others_the_mean_of_its_steps():
    state = LoopState()
    step(state, [1.0, 7.0])   # a step of 2 micro-batches: mean 4
    step(state, [2.0])        # a short last step: mean 2
    assert state.loss_count == 2
    assert float(state.metric_sums["kl"]) / state.loss_count == pytest.approx(3.0)
    assert float(state.metric_sums["gap/max"]) == 7.0


def test_a_resume_on_another_number_of_ranks_keeps_the_largest_and_the_mean():
    state = LoopState()
    meta = {"step": 3, "epoch": 0, "samples_in_epoch": 6, "total_loss": 0.0, "total_loss_steps": 0,
            "pending_loss_count": 2, "pending_loss_counts": "steps", "pending_loss_sums": [4.0, 6.0],
            "pending_metric_sums": {"kl": [1.0, 3.0], "gap/max": [0.5, 0.25]}}
    plan = SimpleNamespace(world_size=1)
    restore_loop_state(state, meta, plan, SimpleNamespace(device="cpu", process_index=0), False, 1)
    assert float(state.metric_sums["kl"]) == 2.0
    assert float(state.metric_sums["gap/max"]) == 0.5
