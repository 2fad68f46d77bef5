"""launch.start_method: how workers start (runner/launch/start_method.py)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch

from runner.config.spec import LaunchSpec, StartMethod
from runner.launch import start_method
from runner.launch.start_method import adopt, environment_for, resolve


@pytest.mark.parametrize("cuda, expected", [(False, "forkserver"), (True, "spawn")])
def test_auto_forks_from_a_server_without_cuda_and_spawns_with_it(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve(LaunchSpec()) == expected


@pytest.mark.parametrize("chosen", [StartMethod.spawn, StartMethod.forkserver])
def test_a_chosen_method_is_kept_on_any_machine(monkeypatch, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve(LaunchSpec(start_method=chosen)) == chosen.value


def test_a_worker_takes_the_launchs_environment_under_what_elastic_set_for_its_rank(monkeypatch):
    """What the server started with, what the launch has now (one variable changed, one
    gone, one new), and the rank's variables torch elastic set over the server's."""
    server = {"PATH": "/bin", "RUNNER_PLANNED": "4", "STALE": "1", "OMP_NUM_THREADS": "2"}
    launch = {"PATH": "/bin", "RUNNER_PLANNED": "2", "NEW": "x", "OMP_NUM_THREADS": "1"}
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "environ", {**server, "RANK": "1", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    adopt((server, launch))
    assert os.environ == {"PATH": "/bin", "RUNNER_PLANNED": "2", "NEW": "x", "OMP_NUM_THREADS": "1", "RANK": "1",
                          "WORLD_SIZE": "2"}
    assert threads == [1]


def test_a_spawned_worker_keeps_its_inherited_environment(monkeypatch):
    monkeypatch.setattr(os, "environ", {"A": "1", "OMP_NUM_THREADS": "3"})
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert environment_for("spawn") is None
    adopt(None)
    assert os.environ == {"A": "1", "OMP_NUM_THREADS": "3"} and threads == [3]


def _report(environment: start_method.Environment, queue: "multiprocessing.SimpleQueue[tuple[bool, str]]") -> None:
    imported = start_method.WORKER_MODULE in sys.modules  # before anything here imports it
    adopt(environment)
    queue.put((imported, os.environ.get("RUNNER_TEST_LAUNCH", "unset")))


@pytest.mark.multiprocess
def test_a_forked_worker_has_the_modules_imported_and_this_launchs_environment(monkeypatch):
    """The server imports the worker's modules once; a worker forked from it runs in the
    environment of the launch that started it, not the one the server started with
    (a launch of a sweep after the first)."""
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "first")
    environment_for("forkserver")  # the server starts (or already runs: then this checks the first case's rule too)
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "second")
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    worker = context.Process(target=_report, args=(environment_for("forkserver"), queue))
    worker.start()
    worker.join(timeout=120)
    assert worker.exitcode == 0
    assert queue.get() == (True, "second")


def _signals_and_pid(environment: start_method.Environment,
                     queue: "multiprocessing.SimpleQueue[tuple[object, int, object]]") -> None:
    import signal

    inherited = signal.getsignal(signal.SIGTERM)
    adopt(environment)
    queue.put((inherited, os.getppid(), signal.getsignal(signal.SIGTERM)))


@pytest.mark.multiprocess
def test_the_server_outlives_a_sigterm_to_the_group_and_its_workers_answer_it():
    """A requeued Slurm job's SIGTERM reaches the launcher's whole process group, the
    forkserver included: had it died, its workers' exits would read as 255 to torch
    elastic, which would shut them down before their checkpoint (seen: the requeue test of
    tests/test_cluster.py came back with no checkpoint). The server ignores it; a worker
    gets the default back (its training loop installs its own handler)."""
    import signal

    environment = environment_for("forkserver")
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    worker = context.Process(target=_signals_and_pid, args=(environment, queue))
    worker.start()
    worker.join(timeout=120)
    inherited, server, after = queue.get()
    assert inherited == signal.SIG_IGN and after == signal.SIG_DFL
    os.kill(server, signal.SIGTERM)
    time.sleep(1)
    os.kill(server, 0)  # still there: raises ProcessLookupError if the signal had killed it
    second = context.Process(target=_signals_and_pid, args=(environment, queue))
    second.start()
    second.join(timeout=120)
    assert second.exitcode == 0 and queue.get()[1] == server


@pytest.mark.e2e  # a fresh interpreter that imports the worker's libraries
def test_the_server_preloads_what_a_worker_imports_and_leaves_it_to_the_collectors_sight(tmp_path):
    """runner/launch/worker_preload.py in a fresh interpreter, as the server imports it:
    what every run imports is there, what the server holds is frozen (a worker's
    collections skip it), and the server itself ends without the interpreter's teardown
    (forkserver_preload), after its exit handlers."""
    import subprocess

    script = (
        "import atexit, gc, sys\n"
        "import runner.launch.forkserver_preload\n"
        "atexit.register(lambda: sys.stderr.write('ATEXIT\\n'))  # as a library the server imports next\n"
        "import runner.launch.launcher, runner.launch.worker_preload as w\n"
        "missing = [m for m in w.EVERY_RUN if m not in sys.modules]\n"
        "print(missing, gc.get_freeze_count() > 10000, 'matplotlib.pyplot' in sys.modules)\n"
        "class Teardown:\n"
        "    def __del__(self):\n"
        "        sys.stderr.write('TEARDOWN\\n')\n"
        "sys.modules['runner_test_teardown'] = Teardown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] True True", done.stdout
    assert "ATEXIT" in done.stderr and "TEARDOWN" not in done.stderr, done.stderr[-2000:]


def test_a_preloaded_module_that_fails_is_left_to_the_worker_and_one_not_installed_is_skipped(monkeypatch, tmp_path):
    from runner.launch.worker_preload import preload

    (tmp_path / "runner_test_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preload(("runner_test_broken", "runner_test_not_installed.sub", "json")) == ["runner_test_broken"]
