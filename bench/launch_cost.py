"""What one `runner` launch costs beside its training: CPU-seconds of the whole process tree
(the launcher, the forkserver, every worker) and wall seconds, for the tiny model's short
run at 1 and 2 processes, workers forked from the forkserver (launch.start_method=auto on
a CPU) against spawned (each worker a fresh interpreter). Ratios against spawn, in the
same run.

    python bench/launch_cost.py [--repeats 2] [--steps 8]

The whole tree is counted: this process becomes the child subreaper (Linux prctl), so the
forkserver and the workers, orphaned when the launcher leaves, are reaped here and their
CPU time lands in RUSAGE_CHILDREN.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
TINY = ["recipe=gpt2_clm_tiny", "model.config_overrides='n_embd=32,n_layer=1,n_head=2,n_positions=64'",
        "data.block_size=32", "data.max_train_samples=96", "data.max_eval_samples=16", "train.per_device_batch_size=4",
        "tracking=none"]


def reap_all() -> None:
    """Wait for every descendant re-parented here (the forkserver ends when the launcher does)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def one_launch(nproc: int, method: str, steps: int, folder: Path) -> tuple[float, float]:
    """(CPU-seconds of the whole tree, wall seconds) of one launch."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "runner", *TINY, f"train.max_steps={steps}",
                           f"launch.nproc_per_node={nproc}", f"launch.start_method={method}",
                           f"hydra.run.dir={folder}"], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    reap_all()
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({nproc} x {method}):\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed: this bench counts a process tree on Linux only")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for nproc in (1, 2):
            measured = {}
            for method in ("spawn", "auto"):
                if nproc == 1 and method == "spawn":
                    continue  # one process runs in the launcher whatever the method (runner/launch/launcher.py)
                runs = [one_launch(nproc, method, args.steps, Path(scratch) / f"{nproc}_{method}_{i}")
                        for i in range(args.repeats)]
                measured[method] = (min(r[0] for r in runs), min(r[1] for r in runs))
            for method, (cpu, wall) in measured.items():
                base = measured.get("spawn")
                ratio = f"{cpu / base[0]:.2f}x CPU, {wall / base[1]:.2f}x wall" if base and method != "spawn" else ""
                rows.append((nproc, method, cpu, wall, ratio))
    print(f"{'processes':>9} {'start':>9} {'CPU-s':>7} {'wall s':>7}  against spawn")
    for nproc, method, cpu, wall, ratio in rows:
        print(f"{nproc:>9} {method:>9} {cpu:>7.1f} {wall:>7.1f}  {ratio}")


if __name__ == "__main__":
    main()
