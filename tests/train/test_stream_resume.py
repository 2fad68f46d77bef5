"""A streamed run (data.streaming=true) survives kill -9 bit for bit, at one and two
processes, with dropout on, shuffled, across epoch boundaries; a bad record mid-stream
stops it with one line and leaves the last checkpoint intact.

One-process runs go through the CLI in this process (runs.run_cli); a killed run, a
two-process launch and a run whose workers are patched (a sitecustomize.py) get a
process of their own."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from runner.config.paths import asset_path
from conftest import patch_train_step
from runner.train.checkpoint import COMPLETE_MARKER, complete_checkpoints, read_marker
from runs import Ran, cmd, losses, resume_cmd, run_cli
from test_checkpoint import kill_9_after_checkpoint, wait_for

# 40 blocks a pass (over all ranks) in 16-block shuffle windows: at 4 per micro-batch an
# epoch is 10 steps on one process, 5 on two, so a resume from step 15 crosses epochs.
STREAM = ["data.streaming=true", "data.shuffle_buffer=16", "data.max_train_samples=40", "data.validation_blocks=8",
          "train.save_every=5"]


def launched(command: list[str], two_processes: bool) -> Ran | subprocess.CompletedProcess:
    """A two-process launch from a process of its own: the launcher's forkserver (runner/launch/
    start_method.py) would otherwise outlive the test in pytest's process; one process here."""
    if two_processes:
        return subprocess.run(command, capture_output=True, text=True, timeout=900)
    return run_cli(command)


def streamed_run(run_dir: Path, *extra: str, two_processes: bool = False) -> dict[int, float]:
    done = launched(cmd(run_dir, *STREAM, *extra), two_processes)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


def kill_and_resume(tmp_path: Path, *extra: str) -> tuple[dict[int, float], dict[int, float], str]:
    two_processes = "launch.nproc_per_node=2" in extra
    reference = streamed_run(tmp_path / "full", *extra, two_processes=two_processes)
    run_dir = tmp_path / "cut"
    kill_9_after_checkpoint(cmd(run_dir, *STREAM, *extra), run_dir, step=15)  # an odd step, mid-epoch
    done = launched(resume_cmd(run_dir), two_processes)
    assert done.returncode == 0, done.stderr[-3000:]
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
    done = run_cli(cmd(run_dir, *overrides))
    assert done.returncode == 2, done.stderr[-3000:]
    named = [line for line in done.stderr.splitlines() if f"{bad}:151: malformed JSON" in line]
    assert len(named) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Failed to load JSON" not in done.stderr  # datasets' own log line, said once by runner instead
    last = complete_checkpoints(run_dir)[-1]
    assert int(last.name[5:]) >= 15 and read_marker(last)["step"] == int(last.name[5:])
    assert f"the last checkpoint, {last}, is intact" in named[0]
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
    assert (last / COMPLETE_MARKER).is_file()


def austen_lines(n: int, words: int = 0) -> list[str]:
    """The vendored corpus's first n non-blank lines (each cut to `words` words, if given)."""
    with gzip.open(asset_path("austen.txt.gz"), "rt", encoding="utf-8") as handle:
        lines = itertools.islice((ln.rstrip("\n") for ln in handle if ln.strip()), n)
        return [" ".join(ln.split()[:words]) if words else ln for ln in lines]


def rank_blocks(log: Path) -> dict[int, list[str]]:
    """Each rank's micro-batches as the patched train_step logged them: 'step ids' lines."""
    return {int(f.stem[4:]): f.read_text().splitlines() for f in sorted(log.glob("rank*.txt"))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("validation_file", [False, True])
def test_every_ranks_blocks_after_a_resume_in_a_later_window_are_its_own(tmp_path, validation_file):
    """Two files on two processes (whole files per rank, or every other block when blocks
    are held out of the stream), killed after an odd step inside a later shuffle window:
    each rank's micro-batches after the resume are the uninterrupted run's, and so is
    every loss, bit for bit, dropout on."""
    data = tmp_path / "data"
    data.mkdir()
    lines = austen_lines(2000)
    for i in range(2):
        (data / f"{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[i * 1000:(i + 1) * 1000]))
    extra = [f"data.train_file={data}/*.jsonl", "data.streaming=true", "data.shuffle_buffer=4", "data.validation_blocks=8",
             "data.max_train_samples=null", "train.per_device_batch_size=2", "train.max_steps=8", "train.save_every=3",
             "launch.nproc_per_node=2"]
    if validation_file:
        (tmp_path / "val.txt").write_text("Validation text, kept apart from training. " * 40)
        extra.append(f"data.validation_file={tmp_path / 'val.txt'}")

    def logging_env(name: str) -> dict[str, str]:
        (tmp_path / name).mkdir()
        record = (f"open(os.path.join({str(tmp_path / name)!r}, 'rank' + os.environ['RANK'] + '.txt'), 'a')"
                  ".write(f'{self.state.step} {batch[\"input_ids\"].tolist()}\\n')")
        return {**os.environ, **patch_train_step(tmp_path / name, "True", record)}

    done = subprocess.run(cmd(tmp_path / "full", *extra), env=logging_env("full_log"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "cut"
    proc = subprocess.Popen(cmd(run_dir, *extra), env=logging_env("cut_log"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(run_dir / "checkpoints" / "step_3" / COMPLETE_MARKER, proc)  # 6 blocks a rank: the second 4-block window
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(resume_cmd(run_dir), env=logging_env("resumed_log"), capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_3" in resumed.stderr
    full, after = rank_blocks(tmp_path / "full_log"), rank_blocks(tmp_path / "resumed_log")
    assert sorted(full) == sorted(after) == [0, 1]
    for rank in (0, 1):
        assert len(full[rank]) == 8
        assert after[rank] == full[rank][3:], f"rank {rank} trained other blocks after the resume"
    assert full[0] != full[1]
    assert losses(run_dir) == losses(tmp_path / "full")


@pytest.mark.e2e
def test_a_stream_that_gives_no_step_stops_with_one_line_instead_of_spinning(tmp_path, monkeypatch):
    """The launcher refuses such a stream (tests/launch/test_preflight_stream.py); should
    the data shrink after that check, the trainer stops on its second empty pass in a row
    instead of re-opening empty passes forever at 100% CPU, deaf to SIGTERM."""
    import runner.launch.preflight as preflight

    monkeypatch.setattr(preflight, "first_step", lambda *args, **kwargs: None)  # the launcher's check passes
    overrides = ["data.streaming=true", "data.validation_blocks=4", "data.max_train_samples=4",
                 "train.per_device_batch_size=8"]
    done = run_cli(cmd(tmp_path / "run", *overrides))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "a pass over the training data gives no optimizer step" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.mark.e2e
def test_a_changed_file_list_under_the_glob_is_refused_and_a_resized_file_is_named(tmp_path):
    """A checkpoint's position counts files by their place in the glob's list: a file that
    sorts first, added between save and resume, would re-train a file already seen."""
    data = tmp_path / "data"
    data.mkdir()
    lines = austen_lines(600)
    for i, part in ((1, lines[:300]), (2, lines[300:])):
        (data / f"{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    run_dir = tmp_path / "run"
    overrides = [f"data.train_file={data}/*.jsonl", "data.streaming=true", "data.validation_blocks=4",
                 "data.max_train_samples=null", "train.max_steps=4", "train.save_every=2"]
    done = run_cli(cmd(run_dir, *overrides))
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_marker(run_dir / "checkpoints" / "step_4")["data_files"] == [
        [str((data / f"{i}.jsonl").resolve()), (data / f"{i}.jsonl").stat().st_size] for i in (1, 2)]

    def resume(*extra: str) -> Ran:
        return run_cli(cmd(run_dir, *overrides, "resume=auto", "train.max_steps=6", *extra))

    (data / "0.jsonl").write_text((data / "1.jsonl").read_text())
    refused = resume()
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"changed since the checkpoint (added {(data / '0.jsonl').resolve()})" in refused.stderr
    assert "Traceback" not in refused.stderr and read_marker(complete_checkpoints(run_dir)[-1])["step"] == 4
    (data / "0.jsonl").unlink()
    with open(data / "2.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "a record added at the end of the last file"}) + "\n")
    accepted = resume()
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert f"resume: accepted change data.train_file: {(data / '2.jsonl').resolve()} (" in accepted.stderr


@pytest.mark.multiprocess
def test_a_streamed_mixture_killed_at_two_processes_resumes_bit_for_bit(tmp_path):
    """data.mixture streamed: the novels (0.7) and a source of a few blocks (0.3, all_exhausted,
    so it starts again within the first pass), shuffled in windows, dropout on, killed at
    step 15 and resumed: every step bit for bit, and the blocks trained per source, carried
    in the checkpoints' stream positions, as the uninterrupted run counted them."""
    small = tmp_path / "small.txt"
    small.write_text("\n".join(austen_lines(2430)[2400:]) + "\n")
    mixture = (f"data.mixture=[{{name:novels,train_file:'{asset_path('austen.txt.gz')}',weight:0.7}},"
               f"{{name:small,train_file:'{small}',weight:0.3}}]")
    reference, resumed, stderr = kill_and_resume(tmp_path, "data.train_file=null", mixture, "data.mixture_stopping=all_exhausted",
                                                 "launch.nproc_per_node=2", "train.per_device_batch_size=2")
    assert "resuming from" in stderr and "step_15" in stderr
    assert sorted(resumed) == list(range(1, 25))
    assert [s for s in reference if resumed[s] != reference[s]] == []
    shares = [json.loads((tmp_path / run / "all_results.json").read_text())["mixture"] for run in ("full", "cut")]
    assert shares[0] == shares[1] and sum(m["trained_blocks"] for m in shares[0]) == 24 * 4
    assert [m["source"] for m in shares[0]] == ["novels", "small"] and shares[0][1]["trained_blocks"] > 9
    results = json.loads((tmp_path / "cut" / "all_results.json").read_text())
    assert {"eval_loss/novels", "eval_loss/small"} <= set(results)  # each source's own held-out blocks
