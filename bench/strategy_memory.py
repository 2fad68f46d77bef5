"""Per-rank peak memory of ddp, zero2 and zero3 at 2 processes on a GPT-2-small config.

Not a test: prints measured figures and the ZeRO / DDP ratios. On CPU the figure is
each process's peak RSS, which includes the interpreter and libraries (about 1 GB
that no strategy can partition); on a GPU it is CUDA's max allocated.

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
]


def measure(strategy: str, root: Path) -> list[float]:
    run_dir = root / strategy
    done = subprocess.run(
        [sys.executable, "-m", "runner", *RUN, f"strategy={strategy}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "all_results.json").read_text())["peak_memory_mb_per_rank"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {s: measure(s, Path(tmp)) for s in ("ddp", "zero2", "zero3")}
    ddp = max(results["ddp"])
    print(f"{'strategy':<8} {'rank 0 MB':>10} {'rank 1 MB':>10} {'max / ddp':>10}")
    for name, peaks in results.items():
        print(f"{name:<8} {peaks[0]:>10,.0f} {peaks[1]:>10,.0f} {max(peaks) / ddp:>10.2f}")
    print(f"zero3 / ddp peak per rank: {max(results['zero3']) / ddp:.2f}")


if __name__ == "__main__":
    main()
