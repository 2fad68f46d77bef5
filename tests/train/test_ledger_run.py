"""The goodput ledger of a run (runner/train/ledger.py), end to end: its parts add up to
the launch's wall time, each is where it belongs, and the summary table shows them with
the checkpoint interval Young/Daly suggest."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import MICRO

pytestmark = pytest.mark.e2e


def test_the_parts_add_up_to_the_wall_time_and_the_summary_shows_them(tmp_path):
    run_dir = tmp_path / "run"
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "runner", *MICRO, "train.eval_every=4", "train.save_every=4",
                           "launch.mtbf_hours=2", f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=600)
    elapsed = time.time() - started
    assert done.returncode == 0, done.stderr[-3000:]
    ledger = json.loads((run_dir / "all_results.json").read_text())["goodput"]
    parts, wall = ledger["parts_seconds"], ledger["wall_seconds"]
    assert abs(sum(parts.values()) - wall) <= 0.02 * wall, ledger
    assert wall < elapsed  # from the launcher's start, not the interpreter's
    assert parts["lost_to_restarts"] == 0 and all(parts[p] > 0 for p in ("startup", "steps", "evaluation",
                                                                             "checkpoint_saves", "data_wait"))
    assert 0 < ledger["goodput"] < 1 and ledger["goodput"] == pytest.approx(parts["steps"] / wall, abs=1e-3)
    assert ledger["mean_save_seconds"] > 0 and ledger["suggested_save_every"] >= 1
    assert "goodput" in done.stderr and "checkpoint interval: Young/Daly" in done.stderr
    assert "launch.mtbf_hours=2" in ledger["suggestion"] and "train.save_every=4 is" in ledger["suggestion"]
