"""Online RL (train.objective=grpo) under accumulation: each completion is drawn from its
own generator, seeded by (seed, generation, prompt, sample), one prompt's group a batch,
so 2 x 8 accumulation samples exactly the completions 16 x 1 samples (completions.jsonl
equal to the byte) and trains the same loss and gradient norm at every step, over an
epoch boundary of a prompt count (6) that does not divide the 4 prompts a step. With
dropout off (rl.disable_dropout's default) the sampling log-probs equal the training
pass's (sampling/logp_difference/mean within 1e-5). Two processes against one, under
every strategy, resumed, with the same byte-for-byte samples: `runner certify --objective
grpo` (tests/certify/test_certify_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runs import run_cli

pytestmark = pytest.mark.e2e

COMMON = ["recipe=gpt2_grpo_tiny", "rl.num_generations=4", "train.max_steps=3", "train.eval_every=0",
          "train.log_every=1", "data.max_train_samples=6", "data.max_eval_samples=2", "tracking=none"]


def run(run_dir: Path, layout: list[str]) -> Path:
    done = run_cli([*COMMON, *layout, f"hydra.run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def steps(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


def test_accumulation_samples_and_trains_what_one_micro_batch_does(tmp_path):
    reference = run(tmp_path / "one", ["train.per_device_batch_size=16"])
    other = run(tmp_path / "accumulated", ["train.per_device_batch_size=2", "train.grad_accum_steps=8"])
    assert (other / "completions.jsonl").read_bytes() == (reference / "completions.jsonl").read_bytes()
    mine, theirs = steps(other), steps(reference)
    assert sorted(mine) == sorted(theirs) == [1, 2, 3]
    for step in theirs:
        a, b = mine[step], theirs[step]
        # the generation's figures, averaged over the step's micro-batches by the loop (1 ulp)
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6) and a["reward_std"] == pytest.approx(b["reward_std"], rel=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), step
        # step 1's entropy is 1e-7 apart; after Adam steps of the warm model (entropy 1.2 nats,
        # peaked) the last-bit gradient differences of the two sums reach it: 3e-5 at step 3
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4), step
        assert a["sampling/logp_difference/mean"] < 1e-5, step
    # the rewards really vary (a test on all-zero advantages would prove nothing)
    assert any(r["reward_std"] > 0 for r in theirs.values())
    assert any(r["grad_norm"] > 0 for r in theirs.values())
