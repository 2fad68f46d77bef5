"""Online RL resumed: a checkpoint in the middle of a generation batch (rl.steps_per_generation=2,
saved at the odd step 3, past the epoch boundary of 6 prompts at 4 a step) holds the
batch, so the resumed run trains the samples the uninterrupted one trained, at every
step. In its layout dropout stays on (rl.disable_dropout=false): the resumed run's
dropout stream is the uninterrupted one's (the prompts' loaders draw from a generator of
their own, never from the one dropout draws from), and the completions are equal to the
byte. Read across to 2 processes under zero2 the per-rank batches change, and with them
dropout's masks (docs/resume-and-faults.md), so that resume is held with dropout off
(TRL's default), where the math is the same in any layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

COMMON = ["recipe=gpt2_grpo_tiny", "train.eval_every=0", "train.log_every=1", "data.max_train_samples=6",
          "data.max_eval_samples=2", "tracking=none", "rl.steps_per_generation=2", "train.save_every=3"]
DROPOUT = {"on": ["rl.disable_dropout=false"], "off": []}
ONE = ["train.per_device_batch_size=16"]


def launch(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def steps(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for dropout, setting in DROPOUT.items():
        runs[dropout] = tmp_path_factory.mktemp(f"grpo_whole_dropout_{dropout}") / "run"
        launch([*COMMON, *setting, *ONE, "train.max_steps=6", f"hydra.run.dir={runs[dropout]}"])
    return runs


@pytest.mark.parametrize("dropout, layout", [("on", []),
                                             ("off", ["launch.nproc_per_node=2", "strategy=zero2",
                                                      "train.per_device_batch_size=8"])],
                         ids=["same layout, dropout on", "2 processes zero2"])
def test_a_resume_mid_generation_trains_what_the_uninterrupted_run_trained(uninterrupted, tmp_path, dropout, layout):
    run_dir, setting = tmp_path / "run", DROPOUT[dropout]
    launch([*COMMON, *setting, *ONE, "train.max_steps=3", f"hydra.run.dir={run_dir}"])
    assert (run_dir / "checkpoints" / "step_3").is_dir()
    launch([*COMMON, *setting, *ONE, "train.max_steps=6", *layout, f"hydra.run.dir={run_dir}", "resume=auto"])
    uninterrupted = uninterrupted[dropout]
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
