"""Per-rank memory of each strategy at 2 processes on a GPT-2-small config, beside the plan's estimate.

Not a test: prints measured figures and their ratios to ddp's, measured in the same
invocation. Per rank, read at the last training step (before the final save, whose
ZeRO-3 gather of the full model would dominate):

- `peak`: the most the rank ever held (CUDA max reserved on a GPU; peak RSS on a CPU),
- `held`: what it holds at that step (CUDA reserved; resident set),
- `before model`: the host memory the process held before it built the model
  (interpreter and libraries, which no strategy can shard; all_results.json's
  host_memory_before_model_mb_per_rank), and `peak - before`, what training added,
- `tensor peak` (with --tensor-peak): the most live torch tensors held during step 2
  (torch profiler; on a CPU the analogue of CUDA's max_memory_allocated: no interpreter,
  libraries or allocator slack), from a second run of each strategy.

Beside them, the `dry_run=true` plan's estimate for the same run (runner/train/plan.py:
model states plus the strategy's buffers, activations excluded).

    python bench/strategy_memory.py                       # ~5 minutes on 2 CPU cores
    python bench/strategy_memory.py --strategies ddp,zero3
    python bench/strategy_memory.py --tensor-peak          # twice the runs
    python bench/strategy_memory.py --precision bf16       # a GPU's setting: slow on a CPU without bf16 instructions
    python bench/strategy_memory.py --batch-size 1         # less activation memory beside the same model states
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from runner.launch.memory_estimate import COMPARED_STRATEGIES

EXTRA: list[str] = []  # set from the command line
TENSOR_PEAK_HOOK = Path(__file__).parent / "tensor_peak"  # its sitecustomize.py profiles one step per rank

RUN = [
    "recipe=gpt2_clm_tiny",
    "model.config_overrides=null",  # GPT2Config() = GPT-2 small, 124M parameters
    "data.block_size=128",
    "data.max_eval_samples=2",
    "train.max_steps=3",
    "train.log_every=1",
    "train.eval_every=0",
    "launch.nproc_per_node=2",
    # Freed blocks go back to the OS at once (glibc's thresholds fixed, runner/train/host_memory.py),
    # so "held" is what each strategy needs at that step, not the high-water mark a
    # retaining heap, or glibc's adaptive threshold, would show.
    "launch.retain_freed_memory=false",
]


def estimate_mb(run_dir: Path) -> float:
    """The dry-run plan's per-rank estimate for the run's frozen spec."""
    from runner.config.spec import load_spec
    from runner.launch.fit import estimate_for, model_shape

    spec = load_spec(run_dir / "run_spec.yaml")
    est = estimate_for(model_shape(spec), spec.strategy.kind.value, spec.precision.kind.value, 2)
    return est.device_total / 2**20


def _train(strategy: str, run_dir: Path, env: dict[str, str] | None = None, settings: list[str] | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runner", *(RUN + EXTRA if settings is None else settings), f"strategy={strategy}",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{done.stderr[-3000:]}")


def tensor_peak_mb(strategy: str, root: Path, settings: list[str] | None = None) -> list[float]:
    """Each rank's peak of live tensors in its second step, from a second, profiled run
    (bench/tensor_peak: the profiler's own memory would distort the first run's RSS).
    `settings`: the run's command line (default: this script's)."""
    run_dir, out = root / f"{strategy}-profiled", root / f"{strategy}-tensor-peak"
    path = os.pathsep.join(filter(None, [str(TENSOR_PEAK_HOOK), os.environ.get("PYTHONPATH", "")]))
    _train(strategy, run_dir, {"PYTHONPATH": path, "RUNNER_BENCH_TENSOR_PEAK": str(out)}, settings)
    return [json.loads((out / f"rank{r}.json").read_text())["peak_mb"] for r in (0, 1)]


def measure(strategy: str, root: Path, tensor_peak: bool = False) -> dict[str, list[float]]:
    run_dir = root / strategy
    _train(strategy, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    before = json.loads((run_dir / "all_results.json").read_text())["host_memory_before_model_mb_per_rank"]
    return {
        "peak": last["peak_memory_mb"],
        "held": last["memory_mb"],
        "before model": before,
        "peak - before": [p - b for p, b in zip(last["peak_memory_mb"], before)],
        "plan estimate": [estimate_mb(run_dir)] * 2,
        **({"tensor peak": tensor_peak_mb(strategy, root)} if tensor_peak else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(COMPARED_STRATEGIES),
                        help="comma-separated; the first is the baseline of the ratios (default: %(default)s)")
    parser.add_argument("--tensor-peak", action="store_true",
                        help="also each rank's peak of live tensors in step 2 (torch profiler; a second run per strategy)")
    parser.add_argument("--precision", default="fp32", help="precision=... for every run (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2,
                        help="train.per_device_batch_size (default: %(default)s); activations grow with it, model states do not")
    args = parser.parse_args()
    EXTRA.extend([f"precision={args.precision}", f"train.per_device_batch_size={args.batch_size}"])
    strategies = args.strategies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        results = {s: measure(s, Path(tmp), args.tensor_peak) for s in strategies}
    base = strategies[0]
    figures = ("peak", "held", "before model", "peak - before", "plan estimate") + (("tensor peak",) if args.tensor_peak else ())
    header = f"| strategy | {' | '.join(f'{f} r0 / r1 MB | / {base}' for f in figures)} |"
    print(header)
    print("|---|" + "---|---|" * len(figures))
    for name, measured in results.items():
        cells = []
        for figure in figures:
            values, ref = measured[figure], max(results[base][figure])
            cells.append(f"{values[0]:,.0f} / {values[1]:,.0f} | {max(values) / ref:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")
    for name in strategies[1:]:
        ratios = ", ".join(f"{f} {max(results[name][f]) / max(results[base][f]):.2f}" for f in figures if f not in ("held", "before model"))
        print(f"{name} / {base} per rank: {ratios}")


if __name__ == "__main__":
    main()
