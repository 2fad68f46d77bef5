"""`runner env` prints what a bug report needs and exits 0 on a CPU-only machine."""

import subprocess
import sys

import pytest


@pytest.mark.e2e
def test_runner_env():
    done = subprocess.run([sys.executable, "-m", "runner", "env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for needle in ("python:", "torch:", "transformers:", "accelerate:", "deepspeed:", "datasets:", "hydra-core:",
                   "omegaconf:", "platform:", "CPU cores:", "GPUs:", "DeepSpeed ops can build:", "runner would use:"):
        assert needle in done.stdout, needle


def test_env_lists_each_key_library_beside_its_locked_version(monkeypatch):
    from runner.config import versions
    from runner.report import env_report

    real = versions.installed
    monkeypatch.setattr(env_report, "installed", lambda name: "1.99.0" if name == "accelerate" else real(name))
    monkeypatch.setattr(versions, "installed", lambda name: "1.99.0" if name == "accelerate" else real(name))
    lines = env_report.library_lines()
    locked = versions.locked_versions()["accelerate"]
    assert f"- accelerate: 1.99.0 (locked {locked})   <- differs" in lines
    assert [line for line in lines if line.startswith("- transformers:")][0].endswith(
        f"(locked {versions.locked_versions()['transformers']})")
    differing = len(versions.differences())  # accelerate, and any other library this machine has at another version
    assert differing >= 1 and lines[-1].startswith(f"- verified set: {differing} of ")
    assert f"pip install -c {versions.LOCK_FILE}" in lines[-1]
