"""Beyond one machine, for real: two network hosts and a Slurm cluster on this machine.

`scripts/test-cluster.sh up` (once per session) makes two network namespaces, rtc-node1
(10.213.0.11) and rtc-node2 (10.213.0.12), on a private bridge, each with one slurmd.
The commands of docs/clusters-and-slurm.md run in them and must reproduce single-host ddp. Traffic goes
only between those namespaces and the bridge (they have no other route). Needs root and
the Debian packages `scripts/test.sh` installs as root where apt-get exists. Skipped, with
the reason and what to install, only where they cannot be had here: without root, without
the privilege to create network namespaces, or without the packages and apt-get.
RUNNER_CLUSTER_TESTS=required (CI) turns a skip into an error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import MICRO

pytestmark = pytest.mark.cluster

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "test-cluster.sh"
HOSTS = ("rtc-node1", "rtc-node2")
NODE0 = "10.213.0.11"
# docs/clusters-and-slurm.md, 'Two machines': its commands, one worker per host.
TWO_HOSTS = ["launch.nnodes=2", "launch.nproc_per_node=1", f"launch.rdzv_endpoint={NODE0}:29500", "launch.rdzv_timeout=300"]


def _why_not_here() -> str | None:
    """Why the cluster cannot be built on this machine, naming what to install; None if it can.
    As root with apt-get, missing packages are no reason: scripts/test.sh installs them, and
    without it `up` fails saying what to install."""
    check = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True)
    packages = check.stderr.strip().removeprefix("test-cluster: ") if check.returncode else None
    also = f"; and {packages}" if packages else ""
    if os.geteuid() != 0:
        return f"the cluster tests need root (network namespaces, a bridge, Slurm daemons){also}"
    if packages and shutil.which("apt-get") is None:
        return f"no apt-get here to install the cluster's Debian packages: {packages}"
    probe = f"rtc-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"no privilege to create network namespaces here: {made.stderr.strip()}{also}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    """The two-node cluster, up once for the session and always torn down."""
    reason = _why_not_here()
    if reason and os.environ.get("RUNNER_CLUSTER_TESTS") == "required":
        pytest.fail(f"RUNNER_CLUSTER_TESTS=required, but {reason}", pytrace=False)
    if reason:
        print(f"\nskipping the cluster tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    env = {**os.environ, "SLURM_CONF": "/run/runner-test-cluster/slurm.conf"}
    try:
        started = time.monotonic()
        up = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, f"test-cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
        print(f"\ncluster up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield env
    finally:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=300)


def on_host(host: str, *command: str) -> list[str]:
    """A command inside the host's network namespace, under its hostname, as on a real machine."""
    return ["nsenter", f"--net=/run/netns/{host}", "unshare", "--uts", "sh", "-c",
            'hostname "$1" && shift && exec "$@"', "on-host", host, *command]


def runner_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "runner", *MICRO, *overrides]


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def run_two_hosts(env: dict[str, str], per_host: list[list[str]], timeout: int = 600) -> list[tuple[int, str]]:
    """Start one runner per host at once; (exit code, output) per host."""
    nodes = [subprocess.Popen(on_host(host, *runner_cmd(*overrides)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for host, overrides in zip(HOSTS, per_host)]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return [(node.returncode, out) for node, out in zip(nodes, outputs)]


@pytest.fixture(scope="module")
def single_host_ddp(tmp_path_factory) -> list[float]:
    """The reference: strategy=ddp with 2 processes on one host."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    done = subprocess.run(runner_cmd("launch.nproc_per_node=2", f"hydra.run.dir={run_dir}"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_two_hosts_match_single_host_ddp(cluster, single_host_ddp, tmp_path, strategy):
    run_dir = tmp_path / "run"
    common = [*TWO_HOSTS, f"strategy={strategy}", f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    results = run_two_hosts(cluster, [[*common, "launch.node_rank=0"], [*common, "launch.node_rank=1"]])
    assert [code for code, _ in results] == [0, 0], "\n".join(out[-2000:] for _, out in results)
    got = losses(run_dir)
    delta = max(abs(a - b) for a, b in zip(got, single_host_ddp))
    print(f"\ntwo hosts, {strategy}: {time.monotonic() - started:.1f} s, max |loss - single-host ddp| = {delta:.2e}",
          file=sys.stderr)
    assert len(got) == len(single_host_ddp) == 8
    assert got == pytest.approx(single_host_ddp, abs=1e-4)


def test_two_hosts_given_different_overrides_stop_at_once_naming_the_keys(cluster, tmp_path):
    common = [*TWO_HOSTS, f"hydra.run.dir={tmp_path / 'run'}"]
    started = time.monotonic()
    results = run_two_hosts(cluster, [[*common, "launch.node_rank=0"],
                                      [*common, "launch.node_rank=1", "optim.lr=0.001", "train.max_steps=9"]],
                            timeout=300)
    print(f"\ndifferent overrides: both hosts stopped after {time.monotonic() - started:.1f} s", file=sys.stderr)
    assert all(code != 0 for code, _ in results), "\n".join(out[-2000:] for _, out in results)
    node1 = results[1][1]
    assert "was started with a different spec than rank 0" in node1, node1[-3000:]
    assert "optim.lr: 0.001 here, 0.002 on rank 0" in node1 and "train.max_steps: 9 here, 8 on rank 0" in node1
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or losses(tmp_path / "run") == []


def _slurm(env: dict[str, str], *command: str, timeout: int = 60) -> str:
    done = subprocess.run(list(command), capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"{command}: {done.stderr}"
    return done.stdout


def test_the_documented_sbatch_script_trains_across_both_nodes(cluster, single_host_ddp, tmp_path):
    """The script of docs/clusters-and-slurm.md as written (srun runner ..., one task per node), with sbatch -N 2."""
    import shlex

    script = tmp_path / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.out\n"
        f"srun runner {' '.join(shlex.quote(o) for o in MICRO)} launch.nproc_per_node=1 "
        f"hydra.run.dir={tmp_path}/runs/$SLURM_JOB_ID\n"
    )
    started = time.monotonic()
    job = _slurm(cluster, "sbatch", "-N", "2", "--parsable", "--wait", str(script), timeout=900).strip().split(";")[0]
    elapsed = time.monotonic() - started
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert "ddp on 2 process(es)" in log, log[-3000:]
    got = losses(tmp_path / "runs" / job)
    delta = max(abs(a - b) for a, b in zip(got, single_host_ddp))
    print(f"\nsbatch -N 2: job {job} in {elapsed:.1f} s, max |loss - single-host ddp| = {delta:.2e}", file=sys.stderr)
    assert got == pytest.approx(single_host_ddp, abs=1e-4) and len(got) == 8
    # Both nodes ran a task of the step (sacct, through slurmdbd).
    steps = _slurm(cluster, "sacct", "-j", job, "-n", "-P", "-o", "JobID,State,NodeList")
    assert f"{job}.0|COMPLETED|rtc-node[1-2]" in steps, steps


def test_srun_with_one_task_per_gpu_joins_as_one_rank_per_task(cluster, single_host_ddp, tmp_path):
    """`--ntasks-per-node` above 1 (one task per GPU): each task is a rank, the ranks meet
    at the first node Slurm lists. 2 nodes x 2 tasks x 2 samples = the reference's batch."""
    import shlex

    micro = [o for o in MICRO if not o.startswith("train.per_device_batch_size")]
    script = tmp_path / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=2\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.out\n"
        f"srun runner {' '.join(shlex.quote(o) for o in micro)} train.per_device_batch_size=2 "
        f"hydra.run.dir={tmp_path}/runs/$SLURM_JOB_ID\n"
    )
    started = time.monotonic()
    job = _slurm(cluster, "sbatch", "--parsable", "--wait", str(script), timeout=900).strip().split(";")[0]
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert "ddp on 4 process(es)" in log, log[-3000:]
    got = losses(tmp_path / "runs" / job)
    delta = max(abs(a - b) for a, b in zip(got, single_host_ddp))
    print(f"\nsrun 2 nodes x 2 tasks: job {job} in {time.monotonic() - started:.1f} s, "
          f"max |loss - single-host ddp| = {delta:.2e}", file=sys.stderr)
    assert got == pytest.approx(single_host_ddp, abs=1e-4) and len(got) == 8
    steps = _slurm(cluster, "sacct", "-j", job, "-n", "-P", "-o", "JobID,State,NodeList,NTasks")
    assert f"{job}.0|COMPLETED|rtc-node[1-2]|4" in steps, steps


def _wait(what: str, check, seconds: int, every: float = 1.0):
    """Poll `check` until it returns something truthy; at most `seconds` (and that many polls)."""
    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / every) + 1):
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            break
        time.sleep(every)
    raise AssertionError(f"{what}: not within {seconds} s")


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_requeued_job_resumes_by_itself_and_matches_an_uninterrupted_run(cluster, tmp_path):
    """scontrol requeue: the job checkpoints at the signal, comes back with the same job ID
    and resumes from that checkpoint (resume=auto, run folder named by the job ID)."""
    import shlex

    steps = 20
    overrides = [o for o in MICRO if not o.startswith("train.max_steps")] + [f"train.max_steps={steps}", "launch.nproc_per_node=1"]
    reference = tmp_path / "uninterrupted"
    done = subprocess.run([sys.executable, "-m", "runner", *[o.replace("launch.nproc_per_node=1", "launch.nproc_per_node=2") for o in overrides],
                           f"hydra.run.dir={reference}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    script = tmp_path / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.out\n"
        f"srun runner {' '.join(shlex.quote(o) for o in overrides)} resume=auto hydra.run.dir={tmp_path}/runs/$SLURM_JOB_ID\n"
    )
    job = _slurm(cluster, "sbatch", "--parsable", str(script)).strip().split(";")[0]
    run_dir, log = tmp_path / "runs" / job, tmp_path / f"slurm-{job}.out"
    try:
        _wait("three steps trained", lambda: len(_losses_by_step(run_dir)) >= 3, 600)
        requeued = time.monotonic()
        _slurm(cluster, "scontrol", "requeue", job)
        _wait("resumed after the requeue", lambda: "resumed from" in log.read_text(errors="replace"), 600)
        resumed = time.monotonic()
        _wait("job completed", lambda: "JobState=COMPLETED" in _slurm(cluster, "scontrol", "show", "job", job), 600, every=2)
    finally:
        subprocess.run(["scancel", job], env=cluster, capture_output=True)
    text = log.read_text(errors="replace")
    stopped = [line for line in text.splitlines() if line.startswith("runner: stopped by SIGTERM at step")]
    assert stopped, text[-3000:]
    at_step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert f"resumed from {run_dir}/checkpoints/step_{at_step} at step {at_step}" in text
    assert "Restarts=1" in _slurm(cluster, "scontrol", "show", "job", job)  # the same job, run again
    got, expected = _losses_by_step(run_dir), _losses_by_step(reference)
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    delta = max(abs(got[s] - expected[s]) for s in expected)
    print(f"\nrequeue: stopped at step {at_step}, resumed {resumed - requeued:.1f} s after scontrol requeue, "
          f"max |loss - uninterrupted| = {delta:.2e}", file=sys.stderr)
    assert [got[s] for s in sorted(got)] == pytest.approx([expected[s] for s in sorted(expected)], abs=1e-4)


def test_a_submitit_sweep_runs_its_jobs_on_slurm_like_a_local_sweep(cluster, tmp_path):
    """`runner -m ... hydra/launcher=submitit_slurm`: both jobs run as Slurm jobs on the
    cluster's nodes, and the sweep summary equals the same sweep run locally."""
    sweep = ["-m", *MICRO, "precision=fp32,bf16"]
    local = subprocess.run([sys.executable, "-m", "runner", *sweep, f"hydra.sweep.dir={tmp_path / 'local'}"],
                           capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    started = time.monotonic()
    slurm = subprocess.run(
        [sys.executable, "-m", "runner", *sweep, "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={tmp_path / 'slurm'}",
         "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1", "hydra.launcher.timeout_min=20"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=cluster)
    elapsed = time.monotonic() - started
    assert slurm.returncode == 0, slurm.stderr[-3000:]
    assert "runner: sweep summary" in slurm.stdout and (tmp_path / "slurm" / "summary.md").is_file()
    # Each job ran through Slurm (sacct, via slurmdbd) on a node of the cluster.
    # submitit returns once the results are written, a moment before Slurm marks the jobs done.
    submitit_jobs = {p.name for p in (tmp_path / "slurm" / ".submitit").iterdir()}

    def finished() -> list[list[str]]:
        jobs = [line.split("|") for line in _slurm(cluster, "sacct", "-a", "-X", "-n", "-P", "-o", "JobID,State,NodeList").splitlines()]
        ran = [j for j in jobs if j[0].split("_")[0] in submitit_jobs]
        return ran if len(ran) == 2 and all(state not in ("PENDING", "RUNNING", "COMPLETING") for _, state, _ in ran) else []

    ran = _wait("both sweep jobs finished in sacct", finished, 120, every=2)
    assert all(state == "COMPLETED" and node.startswith("rtc-node") for _, state, node in ran), ran
    # A job's folder is named by its overrides (not its number), so the same job has the
    # same folder name in both sweeps.
    jobs = sorted(p.parent.name for p in (tmp_path / "local").glob("*/all_results.json"))
    assert len(jobs) == 2 and jobs == sorted(p.parent.name for p in (tmp_path / "slurm").glob("*/all_results.json"))
    deltas = []
    for job in jobs:
        here = json.loads((tmp_path / "local" / job / "all_results.json").read_text())
        there = json.loads((tmp_path / "slurm" / job / "all_results.json").read_text())
        deltas += [abs(here[k] - there[k]) for k in ("train_loss", "eval_loss")]
        assert there["eval_loss"] == pytest.approx(here["eval_loss"], abs=1e-4)
        assert there["train_loss"] == pytest.approx(here["train_loss"], abs=1e-4)
    print(f"\nsubmitit sweep on Slurm: 2 jobs in {elapsed:.1f} s, max |loss - local sweep| = {max(deltas):.2e}", file=sys.stderr)

    # Submitted again with resume=auto, the sweep continues: both jobs finished, so both
    # are kept, their files untouched, and the summary says so.
    def digests() -> dict[str, str]:
        import hashlib

        return {str(p.relative_to(tmp_path / "slurm")): hashlib.sha256(p.read_bytes()).hexdigest()
                for job in jobs for p in sorted((tmp_path / "slurm" / job).rglob("*")) if p.is_file()}

    before = digests()
    again = subprocess.run(
        [sys.executable, "-m", "runner", *sweep, "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={tmp_path / 'slurm'}",
         "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1", "hydra.launcher.timeout_min=20", "resume=auto"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=cluster)
    assert again.returncode == 0, again.stderr[-3000:]
    assert digests() == before
    with open(tmp_path / "slurm" / "summary.csv", newline="") as handle:
        import csv

        assert sorted(row["run"] for row in csv.DictReader(handle)) == ["kept", "kept"]
