"""Per-rank peak memory of ddp, zero2 and zero3 at 2 processes on a GPT-2-small config.

Not a test: prints measured figures and the ZeRO / DDP ratios. Two figures per rank,
both read at the last training step (before the final save, whose ZeRO-3 gather of
the full model would dominate): `held` is the memory the rank holds then (CUDA
allocated on a GPU; resident set on a CPU) and `peak` the most it ever held (CUDA max
allocated; peak RSS). On a CPU both include the interpreter and libraries (about
1 GB that no strategy can partition), and the peak also includes the full model
that every rank builds, seeded, before DeepSpeed partitions it.

    python bench/strategy_memory.py            # ~5 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = [
    "recipe=gpt2_clm_tiny",
    "model.config_overrides=null",  # GPT2Config() = GPT-2 small, 124M parameters
    "data.block_size=128",
    "data.max_eval_samples=2",
    "train.per_device_batch_size=2",
    "train.max_steps=3",
    "train.log_every=1",
    "train.eval_every=0",
    "launch.nproc_per_node=2",
    # glibc's default: freed memory goes back to the OS, so "held" is what each strategy
    # needs at that step, not the high-water mark a retaining heap would show.
    "launch.retain_freed_memory=false",
]


def measure(strategy: str, root: Path) -> dict[str, list[float]]:
    run_dir = root / strategy
    done = subprocess.run(
        [sys.executable, "-m", "runner", *RUN, f"strategy={strategy}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    return {"held": last["memory_mb"], "peak": last["peak_memory_mb"]}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {s: measure(s, Path(tmp)) for s in ("ddp", "zero2", "zero3")}
    for figure in ("held", "peak"):
        ddp = max(results["ddp"][figure])
        print(f"\n{figure} memory per rank at the last training step")
        print(f"{'strategy':<8} {'rank 0 MB':>10} {'rank 1 MB':>10} {'max / ddp':>10}")
        for name, measured in results.items():
            values = measured[figure]
            print(f"{name:<8} {values[0]:>10,.0f} {values[1]:>10,.0f} {max(values) / ddp:>10.2f}")
        print(f"zero3 / ddp {figure} per rank: {max(results['zero3'][figure]) / ddp:.2f}")


if __name__ == "__main__":
    main()
