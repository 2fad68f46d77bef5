"""An online RL run as a user starts it (train.objective=grpo, in this process): the run
folder holds completions.jsonl with each generation batch's samples, the goodput ledger
books sampling as its own part (generation), apart from the steps; and a reward function
that returns what is not one number a completion stops the run in one line, exit 2."""

from __future__ import annotations

import json

import pytest
from runs import run_cli

pytestmark = pytest.mark.e2e

COMMON = ["recipe=gpt2_grpo_tiny", "rl.num_generations=4", "train.per_device_batch_size=16", "train.max_steps=3",
          "train.eval_every=0", "train.log_every=1", "data.max_train_samples=6", "data.max_eval_samples=2",
          "tracking=none", "rl.steps_per_generation=2"]


def test_a_run_writes_its_samples_and_books_their_generation_apart(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli([*COMMON, f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    # two generation batches (steps 1-2, 3), each 2 steps x 16 completions, stamped with the first step they train
    assert [s["step"] for s in samples] == [1] * 32 + [3] * 32
    assert all(set(s) >= {"prompt", "completion", "reward", "advantage"} for s in samples)
    parts = json.loads((run_dir / "all_results.json").read_text())["goodput"]["parts_seconds"]
    assert parts["generation"] > 0 and parts["steps"] > 0
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert all("reward" in r and "completions/mean_length" in r for r in steps)
    # the sampling pass's log-probs against the training pass's (fp32): the largest token's
    # difference is at least the mean and within the 1e-5 test_generation.py holds them to
    for r in steps:
        assert 0 <= r["sampling/logp_difference/mean"] <= r["sampling/logp_difference/max"] < 1e-4, r


def test_a_reward_that_returns_no_number_a_completion_stops_the_run_in_one_line(tmp_path):
    bad = "rl.rewards=[{kind:function,function:'tests.components.reward_functions:text_at_three'}]"
    done = run_cli([*COMMON, bad, f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("runner: error:")]
    assert len(lines) == 1 and "rl.rewards[0] (text_at_three)" in lines[0], done.stderr[-2000:]
