"""Runs of the CLI that several test folders share: the checkpoint tests' run, its
commands, running one in this process, and reading back what it logged."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from conftest import MICRO, environment_restored

# 24 steps with a checkpoint every 4: long enough to interrupt, short enough for CI.
# GPT-2's dropout (0.1) stays on, as in every shipped recipe: a resume must continue
# each rank's random stream, not only the weights and the data position.
DROPOUT_ON = "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'"
RUN = [o for o in MICRO if not o.startswith(("train.max_steps", "train.eval_every", "data.max_train_samples",
                                             "model.config_overrides"))] + [
    DROPOUT_ON, "train.max_steps=24", "train.eval_every=0", "train.save_every=4", "data.max_train_samples=64",
]


def cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", *RUN, *extra, f"hydra.run.dir={run_dir}"]


def resume_cmd(run_dir: Path, how: str = "auto") -> list[str]:
    return [sys.executable, "-m", "runner", "--spec", str(run_dir / "run_spec.yaml"), "--run-dir", str(run_dir), "--resume", how]


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by step; each step must be logged exactly once."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line] if path.exists() else []


@dataclass
class Ran:
    """What a test reads from subprocess.run's CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(command: list[str]) -> Ran:
    """`command` (as cmd() or resume_cmd() build it, or runner's arguments alone) run by
    runner.cli.main in this process: what `python -m runner` prints and exits with, without
    a fresh interpreter's ~10-14 CPU-s of imports. A 1-process run trains here
    (runner/launch/launcher.py _in_this_process). Keep a subprocess where a test needs a
    process of its own: a kill, a signal, a run beside the test, a sitecustomize injection.

    As the command would: SystemExit's code (runner's refusals: 2, one line, no traceback),
    an uncaught exception's traceback on stderr and 1. Captured at the file descriptors,
    since runner writes through print, sys.stderr and the logging handlers it installs;
    those are closed and the root logger's own put back after, so a later run's run.log
    and console hold only that run's lines; os.environ and sys.argv are put back too."""
    from runner.cli import exit_status, main

    args = command[3:] if command[:3] == [sys.executable, "-m", "runner"] else command
    root = logging.getLogger()
    handlers, level, argv = list(root.handlers), root.level, list(sys.argv)
    with environment_restored(), _captured() as read:
        try:
            main(list(args))
            code = 0
        except SystemExit as stop:
            code = exit_status(stop)
        except Exception:  # as the interpreter reports it: "Traceback" not in stderr means none
            sys.stderr.write(traceback.format_exc())
            code = 1
        finally:
            for handler in root.handlers:
                if handler not in handlers:
                    handler.close()
            root.handlers[:] = handlers
            root.setLevel(level)
            sys.argv[:] = argv
    out, err = read()
    return Ran(code, out, err)


@contextmanager
def _captured() -> Iterator[Callable[[], tuple[str, str]]]:
    """fds 1 and 2, and sys.stdout / sys.stderr over them, into temporary files (pytest's
    capfd, callable from a helper): C-level writes, print and logging alike. The reader
    it yields gives (stdout, stderr) once the block has ended."""
    files = [tempfile.TemporaryFile() for _ in (1, 2)]
    text: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds, saved_sys = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
    for fd, file in zip((1, 2), files):
        os.dup2(file.fileno(), fd)
    # Never closed: a handler a library made meanwhile (transformers' own) keeps writing to fd 2.
    sys.stdout, sys.stderr = (open(fd, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
                              for fd in (1, 2))
    try:
        yield lambda: (text[0], text[1])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_sys
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        for file in files:
            file.seek(0)
            text.append(file.read().decode("utf-8", "backslashreplace"))
            file.close()
