"""Runs of the CLI that several test folders share: the checkpoint tests' run, its
commands, and reading back what it logged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import MICRO

# 24 steps with a checkpoint every 4: long enough to interrupt, short enough for CI.
# GPT-2's dropout (0.1) stays on, as in every shipped recipe: a resume must continue
# each rank's random stream, not only the weights and the data position.
DROPOUT_ON = "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'"
RUN = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                             "model.config_overrides"))] + [
    DROPOUT_ON, "train.max_steps=24", "train.eval_every=0", "train.save_every=4", "data.max_train_samples=64",
]


def cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *RUN, *extra, f"hydra.run.dir={run_dir}"]


def resume_cmd(run_dir: Path, how: str = "auto") -> list[str]:
    return [sys.executable, "-m", "runner", "--spec", str(run_dir / "run_spec.yaml"), "--run-dir", str(run_dir), "--resume", how]


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by step; each step must be logged exactly once."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line] if path.exists() else []
