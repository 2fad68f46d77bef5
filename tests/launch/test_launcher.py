"""The launcher: the plan it hands its workers; launch.max_restarts at world size 1 (the single
worker is spawned, so it can be restarted)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import patch_train_step
from runs import cmd, losses


def test_the_planned_world_size_is_handed_to_workers_and_not_left_behind(monkeypatch):
    """A launch from a process that later starts a torchrun must not hand its old plan to
    those ranks (seen in CI: rank 1 of a torchrun join was told the plan was 1)."""
    from runner.launch import launcher as launch_module
    from runner.config.spec import RunSpec

    monkeypatch.delenv(launch_module.PLANNED_WORLD_SIZE_ENV, raising=False)
    seen = []

    def fake_launch(spec, spec_path, launched):
        seen.append(os.environ.get(launch_module.PLANNED_WORLD_SIZE_ENV))
        raise RuntimeError("worker failed")

    monkeypatch.setattr(launch_module, "_launch", fake_launch)
    with pytest.raises(RuntimeError):
        launch_module.launch(RunSpec(), spec_path=None)
    assert seen == ["1"]
    assert launch_module.PLANNED_WORLD_SIZE_ENV not in os.environ


def test_the_launch_start_is_handed_to_the_workers_as_a_value(compose_spec, monkeypatch, tmp_path):
    """The goodput ledger's wall time starts when runner.launch.start takes the spec; that
    time reaches the worker as an argument: in this process, and as the spawned entry's own
    argument, which torch elastic gives a restarted worker unchanged. Runs in turn (runner
    certify) get none: each starts its own. Nothing is left in the environment."""
    from runner.launch import launcher

    seen = []
    monkeypatch.setattr(launcher, "prepare_environment", lambda *args, **kwargs: None)
    monkeypatch.setattr(launcher.worker, "run", lambda spec, launched=None: seen.append(("in process", launched)))
    monkeypatch.setattr(launcher, "elastic_launch",
                        lambda config, entry: lambda *args: seen.append(("spawned", config.max_restarts, args)))
    # What a forked worker is handed to take the launch's environment (start_method.py), first.
    monkeypatch.setattr(launcher, "environment_for", lambda method: "environment")
    before = dict(os.environ)
    spec, path = compose_spec("recipe=gpt2_clm_tiny"), tmp_path / "run_spec.yaml"
    launcher.launch(spec, path, 1234.5)
    spec.launch.max_restarts = 1  # one worker that may be restarted: spawned
    launcher.launch(spec, path, 1234.5)
    spec.launch.max_restarts = 0
    launcher.launch_in_turn(spec, [path, tmp_path / "second.yaml"])
    assert seen == [("in process", 1234.5), ("spawned", 1, ("environment", 1234.5, str(path))),
                    ("spawned", 0, ("environment", None, str(path), str(tmp_path / "second.yaml")))]
    assert dict(os.environ) == before


@pytest.mark.multiprocess
def test_max_restarts_restarts_a_single_worker_that_crashes(tmp_path):
    """The one worker dies once at step 10; it is restarted, resumes from checkpoint 8 and
    ends with the losses of a run that never crashed."""
    reference = tmp_path / "reference"
    done = subprocess.run(cmd(reference), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**os.environ, **patch_train_step(
        tmp_path,
        'os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and self.state.step >= 10',
        "os._exit(1)  # as if the process were killed",
    )}
    run_dir = tmp_path / "run"
    done = subprocess.run(cmd(run_dir, "launch.max_restarts=1"), capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in (run_dir / "run.log").read_text()
    assert json.loads((run_dir / "all_results.json").read_text())["train_steps"] == 24
    assert losses(run_dir) == losses(reference)


@pytest.mark.multiprocess
def test_without_restarts_a_single_worker_crash_fails_the_run(tmp_path):
    env = {**os.environ, **patch_train_step(tmp_path, "self.state.step >= 2", "os._exit(1)")}
    done = subprocess.run(cmd(tmp_path / "run", "launch.max_restarts=1"), capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 1 and "worker rank 0 failed" in done.stderr, done.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_user_error_on_rank_1_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, **patch_train_step(
        tmp_path, 'os.environ.get("RANK") == "1"',
        'from runner.config.errors import UserError; raise UserError("data.train_file: unusable on this rank. Fix it.")',
    )}
    done = subprocess.run(cmd(tmp_path / "run", "launch.nproc_per_node=2", "train.per_device_batch_size=2"),
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "[rank 1] runner: error: data.train_file: unusable on this rank. Fix it." in done.stderr
    assert "worker rank 1 failed: exit code 2" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path):
    """The worker dies at step 3, before any checkpoint: the restart starts again from
    step 1, and metrics.jsonl keeps only the new attempt's lines. The goodput ledger marks
    the restart and books as lost the time from the dead attempt's first batch to the new
    one's (steps 1-2 and the restart), not as start-up."""
    env = {**os.environ, **patch_train_step(
        tmp_path, 'os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and self.state.step >= 3', "os._exit(1)",
    )}
    run_dir = tmp_path / "run"
    done = subprocess.run(cmd(run_dir, "launch.max_restarts=1", "train.max_steps=6"), capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, 7))  # losses() also fails on a step logged twice
    ledger = json.loads((run_dir / "all_results.json").read_text())["goodput"]
    parts = ledger["parts_seconds"]
    assert parts["lost_to_restarts"] > 2 * parts["steps"] / 6 and parts["startup"] > 0, ledger
    assert ledger["restarts"] == 1
    assert abs(ledger["parts_sum_seconds"] - ledger["wall_seconds"]) <= 0.02 * ledger["wall_seconds"], ledger


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, caplog):
    """torch waits on `<op>/lock` while it exists: one a killed build left hours ago made a
    run hang in DeepSpeedCPUAdam's constructor. A stale lock goes (said so); a build's own
    (younger than any build takes) and its other files stay."""
    import time

    from runner.launch.launcher import STALE_LOCK_SECONDS, clear_stale_build_locks

    stale, live = tmp_path / "cpu_adam" / "lock", tmp_path / "fused_adam" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
        lock.touch()
        (lock.parent / "build.ninja").write_text("rule")
    hours_ago = time.time() - 3 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    assert STALE_LOCK_SECONDS < 3 * 3600
    with caplog.at_level("WARNING", logger="runner"):
        assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and (stale.parent / "build.ninja").exists()
    assert "left 180 minutes ago by a JIT build that was killed" in caplog.text
    assert clear_stale_build_locks(tmp_path / "absent") == []


def test_the_rank_that_failed_first_is_reported_not_the_peer_it_left_waiting(compose_spec, monkeypatch, tmp_path,
                                                                             capsys):
    """Each rank that raises notes when and why (runner/launch/failure_notes.py); torch
    elastic records only the first exit it sees, under load often the peer whose gloo
    collective broke (seen: 'worker rank 0 failed: ... GLHF' for rank 1's error, in
    test_a_user_error_on_rank_1 and test_a_rank_that_raises_stops_the_run). The launch
    names the earliest note: a UserError's one line, or an exception with its traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from runner.config.errors import RunFailed
    from runner.launch import failure_notes
    from runner.launch.start import launch_failures

    peer = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "none.json"))
    spec = compose_spec("recipe=gpt2_clm_tiny")
    for rank_1_says, callstack, shown in [("exit code 2", "", "worker rank 1 failed: exit code 2"),
                                          ("RuntimeError: injected", "Traceback (most recent call last):\n  boom",
                                           "worker rank 1 failed: RuntimeError: injected")]:
        with failure_notes.collecting() as folder:
            for rank, reason, stack in [(1, rank_1_says, callstack), (0, "RuntimeError: Connection closed by peer", "x")]:
                monkeypatch.setenv("RANK", str(rank))
                failure_notes.note(reason, stack)
            notes = failure_notes.read(folder)
        assert [n.rank for n in notes] == [0, 1] and failure_notes.first(notes).rank == 1
        err = ChildFailedError("worker", {0: peer})
        err.failure_notes = notes  # type: ignore[attr-defined]
        with pytest.raises(RunFailed, match=shown):
            with launch_failures(spec, tmp_path):
                raise err
        above = capsys.readouterr().err
        assert above == (f"[rank 1] {callstack}\n" if callstack else "")
    assert failure_notes.first([]) is None


def test_a_rank_a_fatal_signal_ended_is_reported_though_its_peer_noted_first(compose_spec, monkeypatch, tmp_path,
                                                                             capsys):
    """A rank aborted (NCCL's watchdog) or segfaulted cannot raise; faulthandler writes its
    stack where the launcher looks. Under load its peer's 'Connection closed' note can be
    older than the aborted rank's file (seen in CI: 'worker rank 0 failed: ... GLHF' for
    rank 1's os.abort()): the fatal signal is still the cause."""
    import os
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from runner.config.errors import RunFailed
    from runner.launch import failure_notes
    from runner.launch.start import launch_failures

    spec = compose_spec("recipe=gpt2_clm_tiny")
    peer = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(tmp_path / "none.json"))
    with failure_notes.collecting() as folder:
        monkeypatch.setenv("RANK", "1")
        (folder / "rank_1.fatal").write_text("")  # as watch_fatal_signals() leaves it while rank 1 lives
        monkeypatch.setenv("RANK", "0")
        failure_notes.note("RuntimeError: Connection closed by peer", "Traceback: gloo")
        assert [n.rank for n in failure_notes.read(folder)] == [0]  # an empty file is no failure
        stack = "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  File \"x.py\", line 3 in step\n"
        (folder / "rank_1.fatal").write_text(stack)
        later = time.time() + 5
        os.utime(folder / "rank_1.fatal", (later, later))
        notes = failure_notes.read(folder)
    assert failure_notes.first(notes).rank == 1 and failure_notes.first(notes).signal.name == "SIGABRT"
    err = ChildFailedError("worker", {0: peer})
    err.failure_notes = notes  # type: ignore[attr-defined]
    with pytest.raises(RunFailed, match=r"worker rank 1 failed: Signal 6 \(SIGABRT\) received\. On GPUs .*timeout_minutes"):
        with launch_failures(spec, tmp_path):
            raise err
    assert capsys.readouterr().err == f"[rank 1] {stack}"


@pytest.mark.parametrize("launch, starts", [
    ({"nproc_per_node": "2"}, True),
    ({"nproc_per_node": "1", "max_restarts": 1}, True),  # a restartable worker is never in this process
    ({"nproc_per_node": "1"}, False),  # the worker runs in this process: no server
    ({"nproc_per_node": "two"}, False),  # refused by validation, which reports it
])
def test_the_forkserver_starts_before_validation_only_for_a_launch_that_forks_from_it(monkeypatch, launch, starts):
    """The server imports the workers' libraries while the launcher validates and plans
    (runner/launch/launcher.py start_server_early)."""
    from runner.config.spec import LaunchSpec, RunSpec
    from runner.launch import launcher as launch_module

    started: list[str] = []
    monkeypatch.setattr(launch_module, "environment_for", started.append)
    monkeypatch.setattr(launch_module, "resolve", lambda spec_launch: "forkserver")
    launch_module.start_server_early(RunSpec(launch=LaunchSpec(**launch)))
    assert started == (["forkserver"] if starts else [])
