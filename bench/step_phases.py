"""Where a training step's time goes, runner against the Trainer, phase by phase.

Not a test: prints the figures, asserts nothing, exits 0.

GPT-2 124M from config at batch 8 x `--block` on this machine, each run in its own
subprocess under bench/step_phases_hook (wall-clock marks from torch's hooks, the same in
both loops): runner as it ships, runner with `model.chunked_loss=false`, and the Trainer
(bench/speed_targets.py's worker) with runner's host memory settings. `--rounds` rounds,
interleaved; per phase the median over steps 4.. of every round's run, in seconds:

  body forward   the transformer body's forward
  head forward   the model's forward after the body (runner's chunked head computes its
                 gradients here, in forward)
  head backward  backward from the loss to the body's output
  body backward  the body's backward
  embedding backward  from the gradient at the embedding's output to the token
                 embedding's gradient accumulated (the tied head's summed with it)
  to backward's end  the rest of autograd's (the position embedding's)
  norm and clip  from backward's end to the optimizer's step: each loop's gradient norm
                 and clipping (runner's exact float64 norm, the Trainer's torch float32)
  optimizer      the optimizer's step
  step           from one step's forward to the next's

What it found (docs/benchmarks.md, "The gradient norm's threads"): the heads and bodies
level, and runner's exact norm 4.5x slower in some steps than others on 2 threads.

    python bench/step_phases.py                      # ~6 minutes on 2 CPU cores
    python bench/step_phases.py --rounds 2 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_targets import runner_cmd, trainer_cmd  # noqa: E402
from trainer_vs_runner import _env, _spawn  # noqa: E402

HOOK = Path(__file__).resolve().parent / "step_phases_hook"
MARKS = ["fwd0", "body1", "fwd1", "bodybwd0", "bodybwd1", "acc", "bwd1", "opt0", "opt1"]
PHASES = ["body forward", "head forward", "head backward", "body backward", "embedding backward",
          "to backward's end", "norm and clip", "optimizer"]
STEADY_FROM = 3  # steps before this one (0-based) are warm-up


def steps_of(marks: list[list]) -> list[dict[str, float]]:
    """One dict of marks per completed training step (evaluation forwards have no opt1)."""
    steps, current = [], None
    for name, seconds in marks:
        if name == "fwd0":
            current = {"fwd0": seconds}
        elif current is not None:
            current.setdefault(name, seconds)
            if name == "opt1":
                if all(m in current for m in MARKS):
                    steps.append(current)
                current = None
    return steps


def phases(marks: list[list]) -> list[list[float]]:
    """Per steady step: each phase's seconds, then the whole step's (to the next forward)."""
    steps = steps_of(marks)
    rows = []
    for step, following in zip(steps, steps[1:]):
        rows.append([step[b] - step[a] for a, b in zip(MARKS, MARKS[1:])] + [following["fwd0"] - step["fwd0"]])
    return rows[STEADY_FROM:]


def run(kind: str, work: Path, tag: str, steps: int, block: int, precision: str) -> list[list[float]]:
    out = work / f"{tag}.json"
    tuned = kind == "trainer"
    env = _env(tuned=tuned)
    env["PYTHONPATH"] = f"{HOOK}:{env['PYTHONPATH']}"
    env["RUNNER_BENCH_PHASES"], env["RUNNER_BENCH_PHASES_STEPS"] = str(out), str(steps)
    if kind == "trainer":
        cmd = trainer_cmd(steps, work / f"{tag}-times.json", precision == "bf16", block)
    else:
        extra = ["model.chunked_loss=false"] if kind == "runner, plain loss" else []
        cmd = runner_cmd(work / tag, steps, precision, extra, block)
    _spawn(cmd, env, work / f"{tag}.log")
    return phases(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=128, help="tokens a sequence (batch 8; default 128)")
    parser.add_argument("--steps", type=int, default=11, help="optimizer steps a run (default 11; steady from 4)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args(argv)
    kinds = ["runner", "runner, plain loss", "trainer"]
    rows: dict[str, list[list[float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        for r in range(args.rounds):
            for i, kind in enumerate(kinds):
                rows[kind] += run(kind, Path(tmp), f"{i}-{r}", args.steps, args.block, args.precision)
    print(f"GPT-2 small (124M) from config, batch 8 x {args.block}, {args.precision}, one process; medians over "
          f"steps {STEADY_FROM + 1}..{args.steps - 1} of {args.rounds} round(s), seconds")
    names = PHASES + ["step"]
    print(f"{'phase':20s} | " + " | ".join(f"{k:>18s}" for k in kinds) + " | runner - Trainer")
    print("-" * 20 + "-|-" + "-|-".join("-" * 18 for _ in kinds) + "-|-----------------")
    for p, name in enumerate(names):
        medians = [statistics.median(row[p] for row in rows[k]) for k in kinds]
        print(f"{name:20s} | " + " | ".join(f"{m:18.3f}" for m in medians) + f" | {medians[0] - medians[2]:+.3f}")
    norm = [row[PHASES.index("norm and clip")] for row in rows["runner"]]
    print(f"runner's norm and clip, every steady step: {', '.join(f'{x:.3f}' for x in norm)}")


if __name__ == "__main__":
    main()
