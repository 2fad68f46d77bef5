"""Adapters (peft=lora) against full fine-tuning: step time and peak memory, same model and batch.

Not a test: prints, for each architecture and strategy, full fine-tuning's figures and
the adapters' beside them with their ratio (adapters / full), measured in the same
invocation. Both start from one pretrained base (the architecture's config of
bench/fit_estimate.py, randomly initialised once and saved), train 2 processes x 4
sequences x 128 tokens with the recipe's dropout on, and differ only in `peft`:

- `step s`: the median step time over steps 3-N (the first two warm up; the step time
  of a step is its tokens over its logged tokens_per_s), the faster of `--repeats` runs
  of each, run in turn (full, lora, full, lora) so a machine's drift falls on both;
- `tensor peak MB`: the larger rank's peak of live tensors during step 2, from one more,
  profiled run of each (bench/tensor_peak: on a CPU the analogue of CUDA's
  max_memory_allocated; a frozen base that stays mapped from its file is counted).

    python bench/adapter_speed.py                                  # ~6 minutes on 2 CPU cores
    python bench/adapter_speed.py --archs gpt2 --strategies ddp,zero3 --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fit_estimate import ARCHS, RUN, adapter_run  # bench/ is the script's folder, first on sys.path
from strategy_memory import tensor_peak_mb

TOKENS_PER_STEP = 2 * 4 * 128  # processes x per-device batch x block size (RUN)


def step_seconds(run_dir: Path) -> float:
    """The median step time past the first two steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "loss" in r and r["step"] > 2]
    return statistics.median(TOKENS_PER_STEP / rate for rate in rates)


def timed_run(run_dir: Path, settings: list[str]) -> float:
    done = subprocess.run([sys.executable, "-m", "runner", *settings, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-3000:]}")
    return step_seconds(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="gpt2,llama")
    parser.add_argument("--strategies", default="ddp")
    parser.add_argument("--peft", default="lora", choices=("lora", "dora"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"| arch | strategy | full step s | {args.peft} step s | step ratio | full tensor peak MB | "
          f"{args.peft} tensor peak MB | memory ratio | trainable |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            adapters = adapter_run(arch, Path(tmp) / f"{arch}-base", args.peft)
            full = [o for o in adapters if not o.startswith("peft=")]
            for strategy in args.strategies.split(","):
                common = [*RUN, f"strategy={strategy}", "model.gradient_checkpointing=false"]
                settings = {"full": [*common, *full], args.peft: [*common, *adapters]}
                seconds: dict[str, list[float]] = {kind: [] for kind in settings}
                for repeat in range(args.repeats):
                    for kind, run in settings.items():
                        run_dir = Path(tmp) / f"{arch}-{strategy}-{kind}-{repeat}"
                        seconds[kind].append(timed_run(run_dir, [*run, f"train.max_steps={args.steps}"]))
                peaks = {kind: max(tensor_peak_mb(strategy, Path(tmp) / f"{arch}-{strategy}-{kind}-peak", run))
                         for kind, run in settings.items()}
                results = json.loads((Path(tmp) / f"{arch}-{strategy}-{args.peft}-0" / "all_results.json").read_text())
                fast = {kind: min(times) for kind, times in seconds.items()}
                print(f"| {arch} | {strategy} | {fast['full']:.3f} | {fast[args.peft]:.3f} | "
                      f"{fast[args.peft] / fast['full']:.2f} | {peaks['full']:,.0f} | {peaks[args.peft]:,.0f} | "
                      f"{peaks[args.peft] / peaks['full']:.2f} | {results['trainable_ratio']:.2%} |", flush=True)


if __name__ == "__main__":
    main()
