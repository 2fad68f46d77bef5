"""The run folder's plot: the losses, and for online RL the mean reward beside them."""

from __future__ import annotations

import json

from runner.report.plots import curves, plot_loss_curves


def test_a_causal_lm_run_plots_its_losses_alone():
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "eval_loss": 2.7}]
    panels = curves(rows)
    assert list(panels) == ["cross-entropy loss (nats/token)"]
    assert panels["cross-entropy loss (nats/token)"] == {"train loss": [(1, 3.0), (2, 2.5)], "eval loss": [(2, 2.7)]}


def test_an_online_rl_run_plots_its_reward_beside_the_loss(tmp_path):
    rows = [{"step": 1, "loss": 0.0, "reward": 0.1}, {"step": 2, "loss": 0.01, "reward": 0.2},
            {"step": 2, "eval_reward": 0.15}]
    panels = curves(rows)
    assert panels["mean reward"] == {"train reward": [(1, 0.1), (2, 0.2)], "eval reward": [(2, 0.15)]}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_loss_curves(metrics, tmp_path / "loss_curves.png", title="grpo")
    assert out is not None and out.stat().st_size > 0
