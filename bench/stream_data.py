"""Streaming (data.streaming=true): flat memory whatever the corpus size, and no data stall.

Not a test: writes two text corpora made from the vendored novels (a 20 MB one and, by
default, a 2 GB one: each line numbered so no two lines repeat), then trains the tiny
recipe on each as a stream, each run in its own process, and prints per run the peak RSS
of the training process (all_results.json's peak_memory_mb: on a CPU the peak RSS) and
the share of training time spent waiting for batches (data_wait_fraction: time in the
loader's next() after the first batch, over train_runtime after it; the first batch's
wait, the stream's opening and first shuffle window, is printed beside it). A cached-path run on the vendored corpus is the
baseline for the wait. Two ratios close it:

    peak RSS  <big> / <small>    (the goal: within 10%)
    data wait <fraction>          (the goal: below 5% of step time)

    python bench/stream_data.py                      # ~6 minutes on 2 CPU cores, 2 GB of disk
    python bench/stream_data.py --big-gb 0.2 --steps 100
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSET = REPO / "runner" / "assets" / "austen.txt.gz"


def write_corpus(path: Path, size_bytes: int) -> Path:
    """Numbered lines of the novels, cycled until `size_bytes`: text the tokenizer treats
    as prose, with no line repeated."""
    with gzip.open(ASSET, "rt", encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    written, n = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size_bytes:
            chunk = "".join(f"{n + i} {line}" for i, line in enumerate(lines))
            out.write(chunk)
            written += len(chunk.encode())
            n += len(lines)
    return path


def run(name: str, run_dir: Path, steps: int, *overrides: str) -> dict:
    command = [sys.executable, "-m", "runner", "recipe=gpt2_clm_tiny", f"train.max_steps={steps}", "train.eval_every=0",
               "train.log_every=10", "tracking=none", f"hydra.run.dir={run_dir}", *overrides]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                      "HF_DATASETS_OFFLINE": "1"})
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    results = json.loads((run_dir / "all_results.json").read_text())
    results["wall"] = time.perf_counter() - started
    print(f"{name:<34} peak RSS {results['peak_memory_mb']:>7,.0f} MB   data wait {100 * results['data_wait_fraction']:5.2f}% "
          f"of {results['train_runtime']:6.1f} s training after a first batch of {results['first_batch_seconds']:.2f} s   "
          f"({results['wall']:.0f} s wall)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-gb", type=float, default=2.0, help="size of the big corpus in GB (default 2)")
    parser.add_argument("--small-mb", type=float, default=20.0, help="size of the small corpus in MB (default 20)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--workdir", default=None, help="where the corpora and runs go (default: a temporary folder)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    small = write_corpus(work / "small.txt", int(args.small_mb * 1e6))
    big = write_corpus(work / "big.txt", int(args.big_gb * 1e9))
    print(f"corpora: {small.stat().st_size / 1e6:,.1f} MB and {big.stat().st_size / 1e9:,.2f} GB written in "
          f"{time.perf_counter() - started:.0f} s ({work})", flush=True)

    # glibc's default thresholds: freed logits go back to the OS at once. runner's default
    # (launch.retain_freed_memory=true) keeps them for reuse, which makes the peak RSS of
    # equal runs differ by one 200 MB logits buffer or not (1,648 vs 1,845 MB seen).
    stream = ["data.streaming=true", "data.validation_blocks=50", "launch.retain_freed_memory=false"]
    cached = run("cached path, vendored corpus", work / "cached", args.steps, "launch.retain_freed_memory=false")
    small_name, big_name = f"{args.small_mb:g} MB", f"{args.big_gb:g} GB"
    small_run = run(f"stream, {small_name}, no loader worker", work / "small0", args.steps, f"data.train_file={small}", *stream)
    big_run = run(f"stream, {big_name}, no loader worker", work / "big0", args.steps, f"data.train_file={big}", *stream)
    big_worker = run(f"stream, {big_name}, 1 loader worker", work / "big1", args.steps, f"data.train_file={big}", *stream,
                     "train.dataloader_num_workers=1")

    print()
    print(f"peak RSS  {big_name} / {small_name} stream:       {big_run['peak_memory_mb'] / small_run['peak_memory_mb']:.3f}")
    print(f"peak RSS  stream ({small_name}) / cached:     {small_run['peak_memory_mb'] / cached['peak_memory_mb']:.3f}")
    print(f"data wait stream, no worker:         {100 * big_run['data_wait_fraction']:.2f}% of training time")
    print(f"data wait stream, 1 loader worker:   {100 * big_worker['data_wait_fraction']:.2f}% of training time")
    print(f"data wait cached path (baseline):    {100 * cached['data_wait_fraction']:.2f}% of training time")
    print(f"throughput stream / cached:          {big_run['train_tokens_per_second'] / cached['train_tokens_per_second']:.3f}")


if __name__ == "__main__":
    main()
