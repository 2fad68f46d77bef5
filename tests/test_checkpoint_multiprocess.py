"""Resume and restarts across 2 CPU processes (ddp, gloo). Slow: real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runner.checkpoint import complete_checkpoints
from conftest import patch_train_step
from test_checkpoint import RUN, kill_9_after_checkpoint, losses, resume_ok, sigterm_after_first_log

pytestmark = pytest.mark.slow

DDP = ["launch.nproc_per_node=2", "train.per_device_batch_size=2"]  # global batch 4, as single-process RUN


def cmd(run_dir, *extra):
    return [sys.executable, "-m", "runner", *RUN, *DDP, *extra, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def ddp_uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp_full") / "run"
    done = subprocess.run(cmd(run_dir), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


def test_ddp_kill_9_then_resume_is_bit_exact(ddp_uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    kill_9_after_checkpoint(cmd(run_dir), run_dir)  # the launcher and both workers, no goodbye
    resume_ok(run_dir, timeout=900)
    assert losses(run_dir) == ddp_uninterrupted


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
    done = subprocess.run(cmd(run_dir, "launch.max_restarts=1"), capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "all_results.json").read_text())
    assert results["train_steps"] == 24
    assert losses(run_dir) == ddp_uninterrupted


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_kill_9_then_resume_matches(tmp_path, strategy):
    """Under DeepSpeed the checkpoint is the engine's own, sharded per rank; it resumes too."""
    full = tmp_path / "full"
    done = subprocess.run(cmd(full, f"strategy={strategy}"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "cut"
    kill_9_after_checkpoint(cmd(run_dir, f"strategy={strategy}"), run_dir)
    done = resume_ok(run_dir, timeout=900)
    assert "resuming from" in done.stderr, done.stderr[-3000:]
    resumed, reference = losses(run_dir), losses(full)
    assert sorted(resumed) == sorted(reference)
    assert [resumed[k] for k in sorted(resumed)] == pytest.approx([reference[k] for k in sorted(reference)], abs=1e-5)
