"""Resume and restarts across 2 CPU processes (ddp, zero2, zero3, fsdp; gloo). Slow: real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.train.checkpoint import complete_checkpoints
from conftest import patch_train_step, run_or_dump
from conftest import MICRO
from in_turn import run_in_turn
from runner.report.parity import parity_problems, step_records
from runs import DROPOUT_ON, RUN, losses
from test_checkpoint import kill_9_after_checkpoint, kill_9_at_step, resume_ok, sigterm_after_first_log

pytestmark = pytest.mark.multiprocess

DDP = ["launch.nproc_per_node=2", "train.per_device_batch_size=2"]  # global batch 4, as single-process RUN


def cmd(run_dir, *extra):
    return [sys.executable, "-m", "runner", *RUN, *DDP, *extra, f"hydra.run.dir={run_dir}"]


# The uninterrupted runs the interrupted ones are held to, bit for bit: the same launch
# settings, so they run in turn on one launch of workers (tests/in_turn.py).
UNINTERRUPTED = {"ddp": [], "ddp_log_every_3": ["train.log_every=3"], "zero2": ["strategy=zero2"],
                 "zero3": ["strategy=zero3"], "fsdp": ["strategy=fsdp"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Path]:
    return run_in_turn(tmp_path_factory.mktemp("uninterrupted"),
                       {name: [*RUN, *DDP, *extra] for name, extra in UNINTERRUPTED.items()}, timeout=1800)


@pytest.fixture(scope="module")
def ddp_uninterrupted(uninterrupted):
    return losses(uninterrupted["ddp"])


def test_ddp_kill_9_then_resume_is_bit_exact(ddp_uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    kill_9_after_checkpoint(cmd(run_dir), run_dir)  # the launcher and both workers, no goodbye
    resume_ok(run_dir, timeout=900)
    assert losses(run_dir) == ddp_uninterrupted


def test_ddp_kill_9_between_checkpoints_inside_a_log_window_is_bit_exact(uninterrupted, tmp_path):
    """Each rank's own pending loss sum and dropout stream: the step-8 checkpoint sits
    inside the 7-9 logging window, and the kill comes after step 9 was logged."""
    full = uninterrupted["ddp_log_every_3"]
    run_dir = tmp_path / "run"
    kill_9_at_step(cmd(run_dir, "train.log_every=3"), run_dir, step=9)
    resume_ok(run_dir, timeout=900)
    assert losses(run_dir) == losses(full) and sorted(losses(run_dir)) == list(range(3, 25, 3))
    resumed, reference = (json.loads((d / "all_results.json").read_text()) for d in (run_dir, full))
    assert resumed["train_loss"] == reference["train_loss"] and resumed["eval_loss"] == reference["eval_loss"]


def test_sigterm_to_the_launcher_reaches_every_rank(ddp_uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    code, err = sigterm_after_first_log(cmd(run_dir, "train.save_every=0"), run_dir, timeout=300)
    assert code == 143, err[-3000:]
    assert "--resume auto" in err
    [checkpoint] = complete_checkpoints(run_dir)  # written by both ranks at one agreed step
    resume_ok(run_dir, timeout=900)
    assert losses(run_dir) == ddp_uninterrupted


def test_max_restarts_recovers_from_a_killed_worker(ddp_uninterrupted, tmp_path):
    """Rank 1 dies once at step 10; the launcher restarts both workers, which resume."""
    env = {**os.environ, **patch_train_step(
        tmp_path,
        'os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and self.state.step >= 10',
        "os._exit(1)  # as if the process were killed",
    )}
    run_dir = tmp_path / "run"
    # A collective left waiting on the dead rank gives up in 2 minutes, not the default 30;
    # a launch that still hangs fails with its processes' stacks (CI saw one hang once).
    done = run_or_dump(cmd(run_dir, "launch.max_restarts=1", "launch.timeout_minutes=2"), env, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results["train_steps"] == 24
    assert losses(run_dir) == ddp_uninterrupted
    # The goodput ledger: the restart resumed step 8, so steps 9-10 ran twice; the time from
    # the step-8 save to the restarted loop is lost; the parts still add up to the wall time.
    ledger = results["goodput"]
    parts = ledger["parts_seconds"]
    one_step = parts["steps"] / 24
    assert parts["lost_to_restarts"] > 2 * one_step and parts["startup"] > 0 and parts["checkpoint_saves"] > 0
    assert abs(ledger["parts_sum_seconds"] - ledger["wall_seconds"]) <= 0.02 * ledger["wall_seconds"], ledger
    assert ledger["goodput"] == pytest.approx(parts["steps"] / ledger["wall_seconds"], abs=1e-3)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_kill_9_then_resume_is_bit_exact(uninterrupted, tmp_path, strategy):
    """Under DeepSpeed the checkpoint is the engine's own, sharded per rank, and each
    rank's dropout stream is restored with it: the resumed steps are bit for bit."""
    full = uninterrupted[strategy]
    run_dir = tmp_path / "cut"
    kill_9_at_step(cmd(run_dir, f"strategy={strategy}"), run_dir, step=10)  # two steps past the step-8 save
    done = resume_ok(run_dir, timeout=900)
    assert "resuming from" in done.stderr, done.stderr[-3000:]
    assert losses(run_dir) == losses(full)


# Dropout off: other layouts sum in another order, so only equal math is expected (1e-4).
LAYOUT_RUN = [o if o != DROPOUT_ON else next(m for m in MICRO if m.startswith("model.config_overrides")) for o in RUN]
LAYOUT_RUN = [o for o in LAYOUT_RUN if not o.startswith("train.per_device_batch_size")]


def test_resume_across_layouts_continues_at_the_exact_sample(tmp_path):
    """Global batch 8 throughout, checkpoints at odd steps: 2 processes x 4 to step 3,
    1 x 4 x 2 accumulation to step 9 (2 -> 1), 1 x 8 to step 15, 2 x 4 to the end
    (1 -> 2, whose new rank has no random state of its own). 64 samples make 8 steps an
    epoch, so each change lands mid-epoch; every step matches one uninterrupted 1 x 8 run."""
    layouts = {"2x4x1": ["launch.nproc_per_node=2", "train.per_device_batch_size=4"],
               "1x4x2": ["train.per_device_batch_size=4", "train.grad_accum_steps=2"],
               "1x8x1": ["train.per_device_batch_size=8"]}

    def run(run_dir, layout, *extra):
        return [sys.executable, "-m", "runner", *LAYOUT_RUN, *layouts[layout], "train.save_every=3", *extra,
                f"hydra.run.dir={run_dir}"]

    reference = tmp_path / "reference"
    done = subprocess.run(run(reference, "1x8x1"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "changing"
    for layout, resume, kill_after in (("2x4x1", [], 3), ("1x4x2", ["resume=auto"], 9), ("1x8x1", ["resume=auto"], 15)):
        kill_9_after_checkpoint(run(run_dir, layout, *resume), run_dir, step=kill_after)
        # The next leg must start at this odd step, not at a later one the kill raced past.
        assert complete_checkpoints(run_dir)[-1].name == f"step_{kill_after}"
    done = subprocess.run(run(run_dir, "2x4x1", "resume=auto"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step_15" in done.stderr
    assert "accepted change layout 1x8x1 -> 2x4x1" in done.stderr
    assert parity_problems(step_records(reference / "metrics.jsonl"), step_records(run_dir / "metrics.jsonl")) == []


def test_fsdp_kill_9_then_resume_is_bit_exact(uninterrupted, tmp_path):
    """FSDP2's checkpoint is one shard per rank (torch.distributed.checkpoint, through
    Accelerate's save_state), restored into the sharded model and optimizer with each
    rank's dropout stream: after kill -9 the resumed steps are bit for bit (dropout on)."""
    full = uninterrupted["fsdp"]
    run_dir = tmp_path / "cut"
    kill_9_at_step(cmd(run_dir, "strategy=fsdp"), run_dir, step=10)  # two steps past the step-8 save
    checkpoint = complete_checkpoints(run_dir)[-1]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # the model's and the optimizer's shards, one file per rank
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part
    done = resume_ok(run_dir, timeout=900)
    assert "resuming from" in done.stderr and checkpoint.name in done.stderr, done.stderr[-3000:]
    resumed, reference = losses(run_dir), losses(full)
    assert sorted(resumed) == list(range(1, 25))
    assert [s for s in reference if resumed[s] != reference[s]] == []  # no step differs
