"""Issue 37's targets, measured side by side in one run: GPT-2 124M at batch 8 x 128.

Not a test: prints the figures beside the targets, asserts nothing, exits 0.

Runs, each in its own subprocess, one after another on the same machine:
  runner, fp32:  before  model.chunked_loss=false model.compile=false (the path before issue 37)
                 chunked model.chunked_loss=true  model.compile=false
                 after   model.chunked_loss=true  model.compile=true
  runner, bf16:  after, precision=bf16
  Trainer (run_clm's workflow, bench/trainer_vs_runner.py's worker, with runner's host
  memory settings as environment variables): fp32 and --bf16.
Steady tokens/s over steps `--steady-from`+1..`--steps` (compiling happens in the first
steps); runner's MFU figure is the mean of its metrics.jsonl windows in that range
(runner/report/flops.py). Peak memory: each runner variant again for 3 steps with
bench/tensor_peak (the peak of live tensors in step 2, the CPU's analogue of CUDA's
max_memory_allocated). Then the memory plan at run_clm's 8 x 1024 (a trace on fake
tensors, runner/components/step_trace.py), the plain loss against the chunked one.

    python bench/speed_targets.py                  # ~20 minutes on 2 CPU cores
    python bench/speed_targets.py --steps 40 --steady-from 10

Issue 50's table instead (`--versus-trainer`): runner as it ships (the recipe's defaults)
against the Trainer, fp32 and bf16, at 8 x 128 and 8 x 1024 (as 4 x 2 accumulation: 8 x
1024 does not fit 24 GiB), the Trainer both out of the box and with runner's host memory
settings, each run in its own subprocess, one after another. 8 x 1024 runs `--long-steps`
steps, steady after `--long-steady-from`:

    python bench/speed_targets.py --versus-trainer                 # ~40 minutes on 2 CPU cores
    python bench/speed_targets.py --versus-trainer --blocks 128    # ~12 minutes
    python bench/speed_targets.py --versus-trainer --blocks 128 --repeats 3   # medians of 3 interleaved rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_vs_runner import REPO, TUNED_ENV, _env, _header, _spawn, in_work_folder  # noqa: E402

TENSOR_PEAK_HOOK = Path(__file__).resolve().parent / "tensor_peak"
SMALL = ""  # GPT2Config's defaults: GPT-2 small, 124M parameters
TARGETS = {"mfu": 0.70, "trainer_fp32": 1.8, "trainer_bf16": 2.5, "peak": 0.75}
VARIANTS = {
    "before": ("fp32", ["model.chunked_loss=false", "model.compile=false"]),
    "chunked": ("fp32", ["model.chunked_loss=true", "model.compile=false"]),
    "after": ("fp32", ["model.chunked_loss=true", "model.compile=true"]),
    "after bf16": ("bf16", ["model.chunked_loss=true", "model.compile=true"]),
}


# runner's metrics window: the steps one tokens/s figure covers. Steady state is then the
# windows after --steady-from, which must end a window for runner's steps and the
# Trainer's to be the same ones.
LOG_EVERY = 2


def split_batch(block: int) -> tuple[int, int]:
    """Batch 8 as (per device, accumulation): 4 x 2 above 256 tokens, where 8 x 1024 does
    not fit this machine's 24 GiB (runner's plan refuses it: 24.3 GiB)."""
    return (8, 1) if block <= 256 else (4, 2)


def runner_cmd(run_dir: Path, steps: int, precision: str, extra: list[str], block: int = 128) -> list[str]:
    per_device, accumulation = split_batch(block)
    return [sys.executable, "-m", "runner", "recipe=gpt2_clm_tiny", "model.config_overrides=null",
            f"data.block_size={block}", f"train.per_device_batch_size={per_device}",
            f"train.grad_accum_steps={accumulation}", f"train.max_steps={steps}", "train.eval_every=0",
            f"train.log_every={LOG_EVERY}", "data.max_eval_samples=8", "tracking=none", f"precision={precision}",
            f"hydra.run.dir={run_dir}", *extra]


def run_runner(work: Path, tag: str, steps: int, steady_from: int, precision: str, extra: list[str],
               block: int = 128) -> dict[str, Any]:
    run_dir = work / tag.replace(" ", "_")
    _spawn(runner_cmd(run_dir, steps, precision, extra, block), _env(tuned=False), work / f"{run_dir.name}.log")
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in line]
    steady = [w for w in windows if w["step"] > steady_from]
    tokens = 8 * block
    seconds = sum(LOG_EVERY * tokens / w["tokens_per_s"] for w in steady)
    results = json.loads((run_dir / "all_results.json").read_text())
    return {"tokens_per_s": LOG_EVERY * tokens * len(steady) / seconds,
            "mfu": sum(w["mfu"] for w in steady) / len(steady),
            "compile_seconds": results.get("compile_seconds"), "recompilations": results.get("recompilations")}


def tensor_peak_mb(work: Path, tag: str, precision: str, extra: list[str]) -> float:
    run_dir = work / f"{tag.replace(' ', '_')}-peak"
    return spawn_for_tensor_peak(runner_cmd(run_dir, 3, precision, extra),
                                 work / f"{tag.replace(' ', '_')}-tensor-peak", work / f"{run_dir.name}.log")


def spawn_for_tensor_peak(cmd: list[str], out: Path, log: Path, tuned: bool = False) -> float:
    """Runs `cmd` (one process) under bench/tensor_peak; its peak of live tensors in step 2, MB."""
    env = _env(tuned)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TENSOR_PEAK_HOOK), env.get("PYTHONPATH", "")]))
    env["RUNNER_BENCH_TENSOR_PEAK"] = str(out)
    _spawn(cmd, env, log)
    return json.loads((out / "rank0.json").read_text())["peak_mb"]


def trainer_cmd(steps: int, out: Path, bf16: bool, block: int = 128) -> list[str]:
    """This script's Trainer worker: run_clm's workflow at batch 8 x `block`, its step
    end times written to `out`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer-worker", "--steps", str(steps), "--out", str(out),
           "--block", str(block)]
    return [*cmd, "--bf16"] if bf16 else cmd


def run_trainer(work: Path, tag: str, steps: int, steady_from: int, bf16: bool, block: int = 128,
                tuned: bool = True) -> float:
    """The Trainer's steady tokens/s; `tuned`: with runner's host memory settings."""
    out = work / f"{tag}.json"
    _spawn(trainer_cmd(steps, out, bf16, block), _env(tuned=tuned), work / f"{tag}.log")
    stamps = json.loads(out.read_text())["step_end_times"]
    return (len(stamps) - steady_from) * 8 * block / (stamps[-1] - stamps[steady_from - 1])


def versus_trainer(args: argparse.Namespace, work: Path) -> None:
    """Issue 50's part 4: runner's steady tokens/s against the Trainer's, fp32 and bf16, at
    each block size; the Trainer out of the box and with runner's host memory settings."""
    print(f"GPT-2 small (124M) from config, batch 8, one process, {os.cpu_count()} CPUs; runner as it ships "
          f"(recipe=gpt2_clm_tiny's settings); Trainer = run_clm's workflow (bench/trainer_vs_runner.py)", flush=True)
    rows = []
    for block in args.blocks:
        steps, steady_from = (args.steps, args.steady_from) if block <= 256 else (args.long_steps, args.long_steady_from)
        for precision in args.precisions:
            print(f"8 x {block} ({' x '.join(map(str, split_batch(block)))}), {precision}: runner, Trainer, Trainer with runner's host settings "
                  f"({steps} steps, steady after {steady_from}; {args.repeats} round(s), interleaved) ...", flush=True)
            figures: dict[str, list[float]] = {"runner": [], "plain": [], "tuned": []}
            for round_ in range(args.repeats):
                tag = f"{precision}_{block}" + (f"_{round_}" if args.repeats > 1 else "")
                figures["runner"].append(run_runner(work, f"runner_{tag}", steps, steady_from, precision, [], block)["tokens_per_s"])
                figures["plain"].append(run_trainer(work, f"trainer_{tag}", steps, steady_from, precision == "bf16", block, tuned=False))
                figures["tuned"].append(run_trainer(work, f"trainer_tuned_{tag}", steps, steady_from, precision == "bf16", block, tuned=True))
                print(f"  runner {figures['runner'][-1]:,.1f}  Trainer {figures['plain'][-1]:,.1f}  "
                      f"Trainer tuned {figures['tuned'][-1]:,.1f} tokens/s", flush=True)
            ours, plain, tuned = (statistics.median(figures[k]) for k in ("runner", "plain", "tuned"))
            rows.append((block, precision, ours, plain, tuned))
    if args.repeats > 1:
        print(f"\n(medians of {args.repeats} interleaved rounds)")
    print()
    print(f"{'shape':<9} | {'precision':<9} | {'runner tok/s':>12} | {'Trainer tok/s':>13} | {'x':>5} | "
          f"{'Trainer, runner host settings':>29} | {'x':>5}")
    print(f"{'-' * 9}-|-{'-' * 9}-|-{'-' * 12}-|-{'-' * 13}-|-{'-' * 5}-|-{'-' * 29}-|-{'-' * 5}")
    for block, precision, ours, plain, tuned in rows:
        print(f"{'8 x ' + str(block):<9} | {precision:<9} | {ours:>12,.1f} | {plain:>13,.1f} | {ours / plain:>5.2f} | "
              f"{tuned:>29,.1f} | {ours / tuned:>5.2f}")
    print(f"(runner's host memory settings: {' '.join(f'{k}={v}' for k, v in TUNED_ENV.items())})")
    behind = [f"8 x {b} {p}" for b, p, ours, plain, tuned in rows if ours < max(plain, tuned)]
    print(f"target: runner >= the Trainer in fp32 and bf16, both ways: {'met' if not behind else 'NOT met: ' + ', '.join(behind)}")


def plan_peaks(block: int) -> dict[str, float]:
    """The memory plan's traced micro-batch (activations and temporaries, MB) at 8 x
    `block`, plain loss and chunked."""
    from transformers import GPT2Config

    from runner.components.step_trace import Numerics, trace_step
    from runner.config.spec import ModelSpec

    config = GPT2Config()
    return {name: trace_step(ModelSpec(chunked_loss=chunked), config, 8, block, "fp32", Numerics.fp32).activation_peak / 2**20
            for name, chunked in (("plain", False), ("chunked", True))}


def compare(args: argparse.Namespace, work: Path) -> None:
    print(_header(args).replace("GPT-2 n_embd=64 n_layer=2 n_head=2 n_positions=128", "GPT-2 small (124M)")
          .replace(f"steady state = steps 51..{args.steps}", f"steady state = steps {args.steady_from + 1}..{args.steps}"),
          flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for tag, (precision, extra) in VARIANTS.items():
        print(f"runner {tag} ({precision}, {' '.join(extra)}) ...", flush=True)
        rows[tag] = run_runner(work, tag, args.steps, args.steady_from, precision, extra)
    trainer = {}
    for precision in ("fp32", "bf16"):
        print(f"Trainer {precision} ...", flush=True)
        trainer[precision] = run_trainer(work, f"trainer_{precision}", args.steps, args.steady_from, precision == "bf16")
    peaks = {}
    for tag in ("before", "chunked", "after"):
        print(f"runner {tag}, profiled for its peak of live tensors ...", flush=True)
        peaks[tag] = tensor_peak_mb(work, tag, *VARIANTS[tag])
    plans = plan_peaks(1024)

    print()
    print(f"{'run':<22} | {'steady tokens/s':>15} | {'MFU':>6} | {'compile (s)':>11} | {'recompilations':>14} | {'peak of tensors (MB)':>20}")
    print(f"{'-' * 22}-|-{'-' * 15}-|-{'-' * 6}-|-{'-' * 11}-|-{'-' * 14}-|-{'-' * 20}")
    for tag, r in rows.items():
        compile_s = "-" if r["compile_seconds"] is None else f"{r['compile_seconds']:.1f}"
        recompiles = "-" if r["recompilations"] is None else str(r["recompilations"])
        peak = f"{peaks[tag]:,.0f}" if tag in peaks else "-"
        print(f"runner {tag:<15} | {r['tokens_per_s']:>15,.0f} | {r['mfu']:>6.3f} | {compile_s:>11} | {recompiles:>14} | {peak:>20}")
    for precision, tokens in trainer.items():
        print(f"{'Trainer ' + precision:<22} | {tokens:>15,.0f} | {'':>6} | {'':>11} | {'':>14} | {'':>20}")
    print(f"(Trainer with runner's host memory settings: {' '.join(f'{k}={v}' for k, v in TUNED_ENV.items())})")
    print()
    print(f"memory plan at 8 x 1024 (activations and temporaries of one micro-batch, traced): plain loss "
          f"{plans['plain']:,.0f} MB, chunked {plans['chunked']:,.0f} MB ({plans['chunked'] / plans['plain']:.2f}x)")
    print()
    mfu = rows["after"]["mfu"]
    fp32 = rows["after"]["tokens_per_s"] / trainer["fp32"]
    bf16 = rows["after bf16"]["tokens_per_s"] / trainer["bf16"]
    peak = peaks["after"] / peaks["before"]
    before_fp32 = rows["before"]["tokens_per_s"] / trainer["fp32"]
    for line, ok in (
        (f"runner MFU, fp32: {mfu:.3f} (before: {rows['before']['mfu']:.3f})   target >= {TARGETS['mfu']:.2f}", mfu >= TARGETS["mfu"]),
        (f"runner / Trainer tokens/s, fp32: {fp32:.2f}x (before: {before_fp32:.2f}x)   target >= {TARGETS['trainer_fp32']}x",
         fp32 >= TARGETS["trainer_fp32"]),
        (f"runner / Trainer tokens/s, bf16: {bf16:.2f}x   target >= {TARGETS['trainer_bf16']}x", bf16 >= TARGETS["trainer_bf16"]),
        (f"peak of live tensors, after / before at 8 x 128: {peak:.2f}x ({peaks['after']:,.0f} / {peaks['before']:,.0f} MB)   "
         f"target <= {TARGETS['peak']:.2f}x", peak <= TARGETS["peak"]),
    ):
        print(f"{line}: {'met' if ok else 'NOT met'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps a measured run (default 30)")
    parser.add_argument("--steady-from", type=int, default=10, help="steady state starts after this step (default 10)")
    parser.add_argument("--keep", type=Path, default=None, help="keep run folders and logs here")
    parser.add_argument("--versus-trainer", action="store_true", help="issue 50's table only: runner vs the Trainer")
    parser.add_argument("--blocks", type=lambda text: [int(b) for b in text.split(",")], default=[128, 1024],
                        help="block sizes for --versus-trainer (default 128,1024)")
    parser.add_argument("--precisions", type=lambda text: text.split(","), default=["fp32", "bf16"],
                        help="precisions for --versus-trainer (default fp32,bf16)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--versus-trainer: rounds of the three runs, interleaved; the table shows medians (default 1)")
    parser.add_argument("--long-steps", type=int, default=8, help="steps a run at a block above 256 (default 8)")
    parser.add_argument("--long-steady-from", type=int, default=4, help="steady after this step above 256 (default 4)")
    parser.add_argument("--block", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--trainer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steady_from % LOG_EVERY or args.long_steady_from % LOG_EVERY:
        # An odd one would start runner's steady windows a step before the Trainer's.
        parser.error(f"--steady-from and --long-steady-from must be multiples of {LOG_EVERY} (runner's metrics window)")
    if args.trainer_worker:
        from trainer_vs_runner import worker_trainer

        per_device, accumulation = split_batch(args.block)
        worker_trainer(args.steps, args.out, SMALL, args.bf16, block=args.block, batch=per_device, accumulation=accumulation)
        return
    chosen = versus_trainer if args.versus_trainer else compare
    in_work_folder(args.keep, "bench-speed-", lambda folder: chosen(args, folder))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
