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
