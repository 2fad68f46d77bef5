"""launch.engine=ray on a local Ray (2 CPU workers, gloo), against the default launch at 2
processes (issue 63): the same steps bit for bit under ddp and fsdp, a worker killed after a
checkpoint and restarted by Ray into the uninterrupted run, and the exit status. One Ray
head serves the module (`ray start --head --block`, its own session, ended with it). Slow:
real workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import patch_train_step, run_or_dump
from in_turn import run_in_turn
from runner.report.parity import step_records
from runs import RUN, losses

pytestmark = pytest.mark.multiprocess

DDP = ["launch.nproc_per_node=2", "train.per_device_batch_size=2"]  # global batch 4
STRATEGIES = {"ddp": [], "fsdp": ["strategy=fsdp"]}
# A collective left waiting on a dead rank gives up in 2 minutes, not the default 30.
RAY_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Ray head of 2 CPUs for the module's runs; its address. Its processes run in a
    session of their own, killed (the whole session) at the end: never `ray stop`, which
    would end every Ray on the machine."""
    started = time.time()
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths must fit 107 characters
    # No token authentication on this machine-local test cluster: a `ray start` where a token
    # exists (~/.ray/auth_token) would turn it on, and the runs would need RAY_AUTH_MODE=token.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    log = Path(temp) / "head.log"  # a file, not a pipe nobody reads: a full pipe would stall the head
    with log.open("w") as out:
        head = subprocess.Popen(
            # Ray's CLI from this interpreter's installation, whether or not its bin/ is on PATH
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
             "--num-cpus=2", "--num-gpus=0", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={temp}"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while not _answers(address):
            assert head.poll() is None and time.time() < deadline, (
                f"the Ray head did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield address
    finally:
        _end_session(head, temp)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        line = f"tests/launch/test_ray_multiprocess.py: {time.time() - started:.0f} s with its Ray head"
        if reporter is not None:
            reporter.write_line(line)
        sys.stderr.write(line + "\n")


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _end_session(head: subprocess.Popen, temp: str) -> None:
    """SIGTERM to the head's session (the head, GCS, raylet, workers), then, as `ray start
    --block` outlives a SIGTERM by more than 30 s here, SIGKILL to all of it after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        try:
            head.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if not subprocess.run(["ps", "-o", "pid=", "-s", str(head.pid)], capture_output=True, text=True).stdout.split():
            break
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """The default launch (torch elastic) at 2 processes, each strategy, in turn on one launch."""
    return run_in_turn(tmp_path_factory.mktemp("default_launch"),
                       {name: [*RUN, *DDP, *extra] for name, extra in STRATEGIES.items()}, timeout=900)


def ray_cmd(address: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *RUN, *DDP, *extra, "launch.engine=ray", f"launch.ray_address={address}",
            "launch.timeout_minutes=2", f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def ray_runs(ray_head, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("ray_launch")
    runs = {}
    for name, extra in STRATEGIES.items():
        run_dir = root / name
        runs[name] = (run_dir, run_or_dump(ray_cmd(ray_head, run_dir, *extra), dict(os.environ), timeout=RAY_TIMEOUT))
    return runs


def banner(run_dir: Path) -> list[str]:
    """The start banner's lines in run.log, the run folder named RUN."""
    lines = (run_dir / "run.log").read_text().replace(str(run_dir), "RUN").splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("runner: starting"))
    body = [line for line in lines[start + 1:start + 40]]
    return [lines[start].split(" INFO ", 1)[1], *body[:next(i for i, line in enumerate(body) if line[:1].isdigit())]]


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_ray_trains_what_the_default_launch_trains_bit_for_bit(strategy, ray_runs, reference):
    run_dir, done = ray_runs[strategy]
    assert done.returncode == 0, done.stderr[-4000:]
    ours, theirs = step_records(run_dir / "metrics.jsonl"), step_records(reference[strategy] / "metrics.jsonl")
    assert sorted(ours) == list(range(1, 25))
    assert ours == theirs  # every step's loss and gradient norm, exactly
    mine, other = weights(run_dir), weights(reference[strategy])
    assert sorted(mine) == sorted(other)
    assert all(mine[name].equal(other[name]) for name in mine)
    print(f"{strategy}: 24 steps equal; loss at step 24 {ours[24]['loss']!r} (both), grad norm "
          f"{ours[24]['grad_norm']!r} (both); {len(mine)} weight tensors equal")


def test_a_finished_ray_run_exits_0_with_its_folder_complete(ray_runs, reference):
    run_dir, done = ray_runs["ddp"]
    assert done.returncode == 0 and "runner: finished" in done.stderr
    expected = {p.name for p in reference["ddp"].iterdir()}
    assert expected <= {p.name for p in run_dir.iterdir()}, expected - {p.name for p in run_dir.iterdir()}
    results, theirs = (json.loads((d / "all_results.json").read_text()) for d in (run_dir, reference["ddp"]))
    assert set(results) == set(theirs) and results["train_steps"] == 24 and results["eval_loss"] == theirs["eval_loss"]
    goodput = results["goodput"]
    assert goodput["restarts"] == 0 and goodput["parts_seconds"]["ray_startup"] > 0
    assert abs(goodput["parts_sum_seconds"] - goodput["wall_seconds"]) <= 0.02 * goodput["wall_seconds"], goodput
    assert banner(run_dir) == banner(reference["ddp"])  # in run.log, as the default launch writes it
    # Ray's own report lines stay out of run.log and the console
    assert "Reporting training result" not in (run_dir / "run.log").read_text() + done.stderr
    # every checkpoint reached Ray, in place (Ray's account of the run lives in the run folder)
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    assert "step_24" in json.dumps(snapshot)
    print(f"finished: exit 0, goodput {goodput['goodput']}, ray_startup {goodput['parts_seconds']['ray_startup']} s, "
          f"parts sum {goodput['parts_sum_seconds']} of {goodput['wall_seconds']} s")


def test_a_worker_killed_after_a_checkpoint_is_restarted_by_ray_into_the_uninterrupted_run(
        ray_head, reference, tmp_path):
    """Rank 1 dies once at step 10 (the step-8 checkpoint reported); launch.max_restarts=1 is
    Ray's max_failures: Ray starts a new group, which resumes step 8 and ends as the run
    that was never interrupted."""
    env = {**os.environ, **patch_train_step(
        tmp_path,
        'os.environ.get("RANK") == "1" and os.environ.get("RUNNER_RESTART_COUNT") == "0" and self.state.step >= 10',
        "os._exit(1)  # as if the process were killed",
    )}
    run_dir = tmp_path / "run"
    done = run_or_dump(ray_cmd(ray_head, run_dir, "launch.max_restarts=1"), env, timeout=RAY_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_8'} at step 8" in (run_dir / "run.log").read_text()
    assert step_records(run_dir / "metrics.jsonl") == step_records(reference["ddp"] / "metrics.jsonl")
    assert losses(run_dir) == losses(reference["ddp"])
    mine, other = weights(run_dir), weights(reference["ddp"])
    assert all(mine[name].equal(other[name]) for name in mine)
    ledger = json.loads((run_dir / "all_results.json").read_text())["goodput"]
    parts = ledger["parts_seconds"]
    assert ledger["restarts"] == 1 and parts["lost_to_restarts"] > 2 * parts["steps"] / 24
    assert abs(ledger["parts_sum_seconds"] - ledger["wall_seconds"]) <= 0.02 * ledger["wall_seconds"], ledger
    print(f"restart: exit 0, resumed at step 8 after rank 1 died at step 10; 24 steps equal the uninterrupted run; "
          f"lost_to_restarts {parts['lost_to_restarts']} s, restarts {ledger['restarts']}")


def test_a_failing_ray_run_exits_non_zero_with_its_error_once(ray_head, tmp_path):
    env = {**os.environ, **patch_train_step(
        tmp_path, 'os.environ.get("RANK") == "1" and self.state.step >= 2',
        'raise ValueError("injected failure on rank 1")')}
    run_dir = tmp_path / "run"
    done = run_or_dump(ray_cmd(ray_head, run_dir, "train.max_steps=4"), env, timeout=RAY_TIMEOUT)
    assert done.returncode == 1, done.stderr[-4000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == ("runner: worker rank 1 failed under Ray Train: ValueError: injected failure on rank 1; "
                    "its error is shown above."), done.stderr[-4000:]
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr[-6000:]
    assert "[rank 1] Traceback" in done.stderr
    assert not (run_dir / "all_results.json").exists()
    print(f"failure: exit {done.returncode}; {last}")
