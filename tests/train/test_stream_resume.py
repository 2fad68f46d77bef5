"""A streamed run (data.streaming=true) survives kill -9 bit for bit, at one and two
processes, with dropout on, shuffled, across epoch boundaries; a bad record mid-stream
stops it with one line and leaves the last checkpoint intact."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
from pathlib import Path

import pytest

from runner.config.paths import asset_path
from runner.train.checkpoint import COMPLETE_MARKER, complete_checkpoints, read_marker
from runs import cmd, losses
from test_checkpoint import kill_9_after_checkpoint, resume_ok

# 40 blocks a pass (over all ranks) in 16-block shuffle windows: at 4 per micro-batch an
# epoch is 10 steps on one process, 5 on two, so a resume from step 15 crosses epochs.
STREAM = ["data.streaming=true", "data.shuffle_buffer=16", "data.max_train_samples=40", "data.validation_blocks=8",
          "train.save_every=5"]


def streamed_run(run_dir: Path, *extra: str) -> dict[int, float]:
    done = subprocess.run(cmd(run_dir, *STREAM, *extra), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


def kill_and_resume(tmp_path: Path, *extra: str) -> tuple[dict[int, float], dict[int, float], str]:
    reference = streamed_run(tmp_path / "full", *extra)
    run_dir = tmp_path / "cut"
    kill_9_after_checkpoint(cmd(run_dir, *STREAM, *extra), run_dir, step=15)  # an odd step, mid-epoch
    done = resume_ok(run_dir, timeout=900)
    return reference, losses(run_dir), done.stderr


@pytest.mark.e2e
def test_streamed_kill_9_then_resume_is_bit_exact(tmp_path):
    reference, resumed, stderr = kill_and_resume(tmp_path)
    assert "resuming from" in stderr and "step_15" in stderr
    assert sorted(resumed) == list(range(1, 25))
    assert [s for s in reference if resumed[s] != reference[s]] == []  # every step, bit for bit
    results = json.loads((tmp_path / "full" / "all_results.json").read_text())
    assert results["epoch"] == 2  # passes completed: 24 steps of 10 a pass
    assert 0 <= results["data_wait_fraction"] < 1


@pytest.mark.multiprocess
def test_streamed_kill_9_then_resume_is_bit_exact_on_two_processes(tmp_path):
    reference, resumed, stderr = kill_and_resume(tmp_path, "launch.nproc_per_node=2")
    assert "resuming from" in stderr and "step_15" in stderr
    assert sorted(resumed) == list(range(1, 25))
    assert [s for s in reference if resumed[s] != reference[s]] == []


@pytest.mark.e2e
def test_a_bad_record_mid_stream_stops_with_one_line_and_the_checkpoint_intact(tmp_path):
    # Short records (a line's first two words): datasets tokenizes 1,000 rows at a time, so
    # the second file's bad record is read once the first 1,000 rows' ~100 blocks (about 25
    # steps) are trained on, after checkpoints at 5, 10, 15 and 20.
    with gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8") as handle:
        lines = [" ".join(ln.split()[:2]) for ln in itertools.islice((ln for ln in handle if ln.strip()), 1600)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:1100]))
    bad = data / "1.jsonl"
    rows = [json.dumps({"text": t}) + "\n" for t in lines[1100:]]
    rows.insert(150, '{"text": "cut off\n')
    bad.write_text("".join(rows))
    run_dir = tmp_path / "run"
    overrides = [f"data.train_file={data}/*.jsonl", "data.streaming=true", "data.shuffle_buffer=16",
                 "data.validation_blocks=8", "data.max_train_samples=null", "train.max_steps=60", "train.save_every=5"]
    done = subprocess.run(cmd(run_dir, *overrides), capture_output=True, text=True, timeout=900)
    assert done.returncode == 2, done.stderr[-3000:]
    named = [line for line in done.stderr.splitlines() if f"{bad}:151: malformed JSON" in line]
    assert len(named) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Failed to load JSON" not in done.stderr  # datasets' own log line, said once by runner instead
    last = complete_checkpoints(run_dir)[-1]
    assert int(last.name[5:]) >= 15 and read_marker(last)["step"] == int(last.name[5:])
    assert f"the last checkpoint, {last}, is intact" in named[0]
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
    assert (last / COMPLETE_MARKER).is_file()
