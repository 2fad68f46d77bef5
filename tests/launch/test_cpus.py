"""Thread counts follow the CPUs a process may use, not the machine's core count."""

import os

import pytest

from runner.launch import cpus
from runner.launch.launcher import prepare_environment


@pytest.fixture
def eight_cores_affinity_six(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)


def test_affinity_caps_the_machines_cores(eight_cores_affinity_six, tmp_path):
    assert cpus.usable_cpus(tmp_path) == 6  # no cgroup files: the affinity decides


@pytest.mark.parametrize("cpu_max, expected", [("max 100000", 6), ("250000 100000", 3), ("50000 100000", 1)])
def test_cgroup_v2_quota_caps_the_affinity(eight_cores_affinity_six, tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert cpus.usable_cpus(tmp_path) == expected


def test_cgroup_v1_quota(eight_cores_affinity_six, tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.usable_cpus(tmp_path) == 2


def test_workers_threads_come_from_usable_cpus(eight_cores_affinity_six, tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    prepare_environment(2)
    assert os.environ["OMP_NUM_THREADS"] == "2"  # 4 usable CPUs / 2 workers, not 8 / 2
