"""launch.engine=ray on a local Ray cluster (two nodes of 1 CPU, 2 workers, gloo), against
the default launch at 2 processes (issue 63): the same steps bit for bit under ddp and
fsdp, a worker killed after a checkpoint and restarted by Ray into the uninterrupted run,
the exit status, and elastic (launch.min_workers): the second node lost, the run goes on
with one worker and still ends as the uninterrupted one. One cluster serves the module.
Slow: real workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import MICRO, patch_train_step, run_or_dump
from in_turn import run_in_turn
from runner.report.parity import parity_problems, step_records
from runs import RUN, losses

pytestmark = pytest.mark.multiprocess

DDP = ["launch.nproc_per_node=2", "train.per_device_batch_size=2"]  # global batch 4
STRATEGIES = {"ddp": [], "fsdp": ["strategy=fsdp"]}
# Dropout off, as for every comparison across layouts (another layout draws other masks).
DROPOUT_OFF = next(o for o in MICRO if o.startswith("model.config_overrides"))
# A collective left waiting on a dead rank gives up in 2 minutes, not the default 30.
RAY_TIMEOUT = 300


class RayCluster:
    """A Ray cluster of two nodes on this machine, 1 CPU each, on loopback: a 2-worker run
    has a worker on each, and the second node can go away (every process of it killed, as
    a lost machine's are) and come back. Each node is a `ray start --block` in a session of
    its own, killed (the whole session) to end it: never `ray stop`, which would end every
    Ray on the machine. (ray.cluster_utils.Cluster, which Ray's own elastic tests use,
    puts its nodes on the machine's network address; on 127.0.0.1 a driver cannot join
    them, Ray 2.60.)"""

    # No token authentication on this machine-local test cluster (a `ray start` where a
    # token exists, ~/.ray/auth_token, would turn it on), no usage report.
    ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

    def __init__(self, temp: str) -> None:
        self.temp, self.port = temp, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head = self._start("head", "--head", f"--port={self.port}", "--include-dashboard=false",
                                "--disable-usage-stats")
        deadline = time.time() + 120
        while not _answers(self.address):
            assert self.head.poll() is None and time.time() < deadline, (
                f"the Ray head did not start: {self._log('head')}")
            time.sleep(0.5)
        self.second = self.add_node()

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = Path(self.temp) / f"{name}.log"  # a file, not a pipe nobody reads: a full pipe would stall the node
        with log.open("a") as out:
            return subprocess.Popen(
                # Ray's CLI from this interpreter's installation, whether or not its bin/ is on PATH
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args, "--num-cpus=1",
                 "--num-gpus=0", "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp}"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.ENV}, start_new_session=True)

    def _log(self, name: str) -> str:
        return (Path(self.temp) / f"{name}.log").read_text()[-3000:]

    def cpus(self) -> int:
        """The CPUs of the nodes alive, as the cluster's GCS counts them."""
        done = subprocess.run([sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], "
                               "logging_level='ERROR'); print(int(ray.cluster_resources().get('CPU', 0)))",
                               self.address], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.ENV})
        return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else -1

    def add_node(self) -> subprocess.Popen:
        # One log monitor a machine, the head's: it reads every node's logs here (one temp
        # folder), and a second would send each worker's lines to the launcher twice.
        node = self._start("second", f"--address={self.address}", "--include-log-monitor=false")
        deadline = time.time() + 120
        while self.cpus() < 2:
            assert node.poll() is None and time.time() < deadline, f"the second node did not join: {self._log('second')}"
            time.sleep(1)
        return node

    def lose_second_node(self) -> None:
        _end_session(self.second, grace=(0, 30))

    def restore_second_node(self) -> None:
        if self.second.poll() is not None:
            self.second = self.add_node()

    def shutdown(self) -> None:
        for node in (self.second, self.head):
            _end_session(node)
        shutil.rmtree(self.temp, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _end_session(node: subprocess.Popen, grace: tuple[float, float] = (5, 30)) -> None:
    """SIGTERM to a node's session (its raylet, its workers; the head's GCS too), then, as
    `ray start --block` outlives a SIGTERM by more than 30 s here, SIGKILL to all of it.
    grace (0, ...): SIGKILL at once, a machine lost."""
    for sig, wait in ((signal.SIGTERM, grace[0]), (signal.SIGKILL, grace[1])):
        if sig == signal.SIGTERM and not wait:
            continue
        try:
            os.killpg(node.pid, sig)
        except ProcessLookupError:
            break
        try:
            node.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not subprocess.run(["ps", "-o", "pid=", "-s", str(node.pid)], capture_output=True, text=True).stdout.split():
            break


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    """The module's Ray cluster, shut down (every process of it) at the end."""
    started = time.time()
    cluster = RayCluster(tempfile.mkdtemp(prefix="rayt"))  # short: Ray's socket paths must fit 107 characters
    try:
        yield cluster
    finally:
        cluster.shutdown()
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        line = f"tests/launch/test_ray_multiprocess.py: {time.time() - started:.0f} s with its Ray cluster"
        if reporter is not None:
            reporter.write_line(line)
        sys.stderr.write(line + "\n")


@pytest.fixture
def ray_head(ray_cluster: RayCluster) -> str:
    """The cluster's address, as launch.ray_address names it, with both nodes up (a test
    before may have lost the second)."""
    ray_cluster.restore_second_node()
    return ray_cluster.address


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """The default launch (torch elastic) at 2 processes, each strategy, in turn on one launch."""
    runs = {name: [*RUN, *DDP, *extra] for name, extra in STRATEGIES.items()}
    return run_in_turn(tmp_path_factory.mktemp("default_launch"), {**runs, "ddp_dropout_off": [*RUN, *DDP, DROPOUT_OFF]},
                       timeout=900)


def ray_cmd(address: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *RUN, *DDP, *extra, "launch.engine=ray", f"launch.ray_address={address}",
            "launch.timeout_minutes=2", f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def ray_runs(ray_cluster, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("ray_launch")
    runs = {}
    for name, extra in STRATEGIES.items():
        run_dir = root / name
        runs[name] = (run_dir, run_or_dump(ray_cmd(ray_cluster.address, run_dir, *extra), dict(os.environ),
                                           timeout=RAY_TIMEOUT))
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


def test_a_lost_node_leaves_a_smaller_group_that_ends_as_the_uninterrupted_run(ray_cluster, ray_head, reference,
                                                                                tmp_path):
    """Elastic (launch.min_workers=1): 2 workers, one on each node. Once the step-8
    checkpoint is reported, the second node goes away with its worker. Ray restarts the
    group on the one CPU left; it resumes step 8 on 1 worker at 2 x accumulation (the
    global batch of 4 kept) and ends as the uninterrupted 2-worker run: steps 1-8 exactly,
    and then too (see below), dropout off as for any change of layout."""
    at_step_10 = tmp_path / "at_step_10"
    env = {**os.environ, **patch_train_step(
        tmp_path, 'os.environ.get("RUNNER_RESTART_COUNT") == "0" and self.state.step >= 10',
        f"open({str(at_step_10)!r}, 'a').close(); time.sleep(300)  # until Ray ends the group")}
    # Ray's view of the cluster lags a lost node by up to 20 s (its autoscaling coordinator's
    # tick), so its first restart asks for 2 workers again and waits for them: 10 s here,
    # not the default 60, before it counts what is left.
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"

    def lose_the_node_at_step_10() -> None:
        deadline = time.time() + RAY_TIMEOUT
        while not at_step_10.exists() and time.time() < deadline:
            time.sleep(0.2)
        if at_step_10.exists():
            ray_cluster.lose_second_node()

    run_dir = tmp_path / "run"
    loser = threading.Thread(target=lose_the_node_at_step_10, daemon=True)
    loser.start()
    try:
        done = run_or_dump(ray_cmd(ray_head, run_dir, DROPOUT_OFF, "launch.min_workers=1", "launch.max_restarts=1"),
                           env, timeout=RAY_TIMEOUT)
    finally:
        loser.join(timeout=RAY_TIMEOUT)  # the next test that needs the node brings it back (ray_head)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.count("runner: starting") == 2  # the console: each group's banner, once
    log = (run_dir / "run.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step_8'} at step 8" in log, log[-3000:]
    banners = [line for line in log.splitlines() if "global batch" in line]
    assert [line.split("global batch", 1)[1].strip() for line in banners] == [
        "4 = 2 per device x 2 process(es) x 1 accumulation", "4 = 2 per device x 1 process(es) x 2 accumulation"]
    # Exactly, not only to equal math's tolerance: two micro-batches' gradients halved and
    # summed on one worker are the two workers' all-reduced sum halved, bit for bit (a sum
    # of two is one rounding either way, and halving is exact).
    ours, theirs = step_records(run_dir / "metrics.jsonl"), step_records(reference["ddp_dropout_off"] / "metrics.jsonl")
    assert sorted(ours) == list(range(1, 25))
    assert ours == theirs, parity_problems(theirs, ours)
    mine, other = weights(run_dir), weights(reference["ddp_dropout_off"])
    assert all(mine[name].equal(other[name]) for name in mine)
    ledger = json.loads((run_dir / "all_results.json").read_text())["goodput"]
    assert ledger["restarts"] == 1, ledger
    print(f"elastic: node lost at step 10; Ray restarted the group on 1 worker, which resumed step 8 at 2 x "
          f"accumulation; exit 0; 24 steps and {len(mine)} weight tensors equal the uninterrupted 2-worker run "
          f"(loss at step 24 {ours[24]['loss']!r}); lost_to_restarts {ledger['parts_seconds']['lost_to_restarts']} s")
