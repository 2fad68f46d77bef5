"""Online RL resumed: a checkpoint in the middle of a generation batch (rl.steps_per_generation=2,
saved at the odd step 3, past the epoch boundary of 6 prompts at 4 a step) holds the
batch, so the resumed run trains the samples the uninterrupted one trained, at every
step, with dropout on (rl.disable_dropout=false): the resumed run's dropout stream is the
uninterrupted one's (the prompts' loaders draw from a generator of their own, never from
the one dropout draws from), and the completions are equal to the byte. Read across to
another world size and strategy (where dropout's masks change with the per-rank batch, so
held with dropout off): `runner certify --joins`'s grpo cells, whose third leg resumes the
2-process checkpoint of step 7, mid-generation, on one process under ddp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runs import run_cli

pytestmark = pytest.mark.e2e

COMMON = ["recipe=gpt2_grpo_tiny", "rl.num_generations=4", "train.eval_every=0", "train.log_every=1",
          "data.max_train_samples=6", "data.max_eval_samples=2", "tracking=none", "rl.steps_per_generation=2", "train.save_every=3"]
DROPOUT = ["rl.disable_dropout=false"]
ONE = ["train.per_device_batch_size=16"]


def launch(args: list[str]) -> None:
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]


def steps(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


def test_a_resume_mid_generation_trains_what_the_uninterrupted_run_trained(tmp_path):
    uninterrupted, run_dir = tmp_path / "whole", tmp_path / "run"
    launch([*COMMON, *DROPOUT, *ONE, "train.max_steps=6", f"hydra.run.dir={uninterrupted}"])
    launch([*COMMON, *DROPOUT, *ONE, "train.max_steps=3", f"hydra.run.dir={run_dir}"])
    assert (run_dir / "checkpoints" / "step_3").is_dir()
    launch([*COMMON, *DROPOUT, *ONE, "train.max_steps=6", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert (run_dir / "completions.jsonl").read_bytes() == (uninterrupted / "completions.jsonl").read_bytes()
    mine, theirs = steps(run_dir), steps(uninterrupted)
    assert sorted(mine) == sorted(theirs) == [1, 2, 3, 4, 5, 6]
    for step in theirs:
        a, b = mine[step], theirs[step]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), step
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-6), step
    # step 4 trains the second half of the generation batch sampled at step 3: off-policy by
    # one update, so its ratio moves off 1 (the saved old log-probs are what it is held to)
    assert theirs[4]["loss"] != 0.0
