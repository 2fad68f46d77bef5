"""Do two runs do the same math? Per-step loss and gradient norm, compared.

The loss alone is a weak witness: AdamW with clipping barely moves when a gradient is
off by a constant factor (say, an accumulation division skipped), and the first
warm-up step runs at lr 0. The gradient norm, read before clipping, shows such a
factor at once. So both are compared at every logged step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Equal math in another layout differs only by float summation order: measured within
# 2e-6 on the loss over 20 steps (DESIGN.md); the norm gets a relative allowance.
LOSS_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-3

# bf16 under two strategies is not equal math: ddp autocasts over fp32 weights, ZeRO runs
# the whole module in bf16, FSDP2 gathers bf16 parameters (each strategy's
# precision_policy, runner/distributed/). They differ by bf16 rounding (8 significant
# bits, 0.4% per rounding) from the first step. Measured on the tiny recipe, dropout
# off, 20 steps, against ddp in one process: zero2 and zero3 up to 6.1e-4 on the loss
# and 0.19% on the gradient norm, fsdp on 2 processes up to 6.3e-4 and 0.13%. The
# allowance is about 8x and 10x that, and still 50x short of a gradient off by a factor
# of 2 (an accumulation division skipped).
BF16_LOSS_ATOL = 5e-3
BF16_GRAD_NORM_RTOL = 2e-2


@dataclass(frozen=True)
class Tolerance:
    """What two runs may differ by at each step, and why."""

    loss_atol: float = LOSS_ATOL
    grad_norm_rtol: float = GRAD_NORM_RTOL
    why: str = "equal math: only the order of float sums differs"

    def describe(self) -> str:
        return f"loss within {self.loss_atol:g} and gradient norm within {self.grad_norm_rtol:.1%}"


EQUAL_MATH = Tolerance()


@dataclass(frozen=True)
class Numerics:
    """What a run computes in: its precision, strategy, the strategy's precision policy,
    and its layout (processes x per-device batch x accumulation, "" when unknown)."""

    precision: str
    strategy: str
    policy: str
    layout: str = ""


def parity_tolerance(run: Numerics, baseline: Numerics) -> Tolerance:
    """bf16 under two different policies, or in two layouts, gets bf16's allowance;
    anything else the equal-math one (a change of precision is a change of math,
    expected to fail). Another layout is equal math in fp32 (only the order of sums
    differs), not in bf16: autocast rounds each matmul's output to bf16, and another
    micro-batch shape sums in another order first, so a rounding can flip from the first
    step (as `runner certify` holds every bf16 cell, runner/certify/matrix.py)."""
    if run.precision != "bf16" or baseline.precision != "bf16":
        return EQUAL_MATH
    if run.policy != baseline.policy:
        return Tolerance(BF16_LOSS_ATOL, BF16_GRAD_NORM_RTOL,
                         f"bf16 under {baseline.strategy} and under {run.strategy} is different numerics, so the "
                         "runs differ by bf16 rounding")
    if run.layout != baseline.layout:
        return Tolerance(BF16_LOSS_ATOL, BF16_GRAD_NORM_RTOL,
                         f"bf16 in layout {baseline.layout or 'unknown'} and in {run.layout or 'unknown'} (processes x "
                         "per-device batch x accumulation) rounds in another order, so the runs differ by bf16 rounding")
    return EQUAL_MATH


def step_records(metrics_path: Path) -> dict[int, dict[str, Optional[float]]]:
    """{step: {"loss", "grad_norm"}} from a run's metrics.jsonl (training lines only)."""
    out: dict[int, dict[str, Optional[float]]] = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[int(row["step"])] = {"loss": row["loss"], "grad_norm": row.get("grad_norm")}
    return out


def parity_problems(
    reference: dict[int, dict[str, Optional[float]]],
    other: dict[int, dict[str, Optional[float]]],
    loss_atol: float = LOSS_ATOL,
    grad_norm_rtol: float = GRAD_NORM_RTOL,
) -> list[str]:
    """Every step where `other` departs from `reference`; empty when they agree."""
    problems = []
    if sorted(reference) != sorted(other):
        problems.append(f"logged steps differ: {sorted(reference)} vs {sorted(other)}")
    for step in sorted(set(reference) & set(other)):
        a, b = reference[step], other[step]
        if a["loss"] is None or b["loss"] is None or abs(a["loss"] - b["loss"]) > loss_atol:
            problems.append(f"step {step}: loss {a['loss']} vs {b['loss']} (allowed {loss_atol:g})")
        ga, gb = a["grad_norm"], b["grad_norm"]
        if ga is None or gb is None:
            problems.append(f"step {step}: grad_norm missing ({ga} vs {gb}); optim.max_grad_norm=0 logs none")
        elif abs(ga - gb) > grad_norm_rtol * abs(ga):
            # a reference norm of 0 (online RL's step whose groups all scored alike) allows none
            apart = f"{abs(ga - gb) / abs(ga):.2%} apart" if ga else "the reference's is 0"
            problems.append(f"step {step}: grad_norm {ga:.6g} vs {gb:.6g} ({apart}, allowed {grad_norm_rtol:.1%})")
    return problems


def figure_problems(reference_path: Path, other_path: Path, names: tuple[str, ...], atol: float = LOSS_ATOL) -> list[str]:
    """Every training step where one of the figures `names` (a preference run's
    rewards/margins, logps/*) departs from `reference_path`'s by more than `atol` x
    max(1, |reference|): the figures of equal math, as the loss is."""

    def figures(path: Path) -> dict[int, dict[str, float]]:
        rows = (json.loads(line) for line in path.read_text().splitlines())
        return {int(row["step"]): row for row in rows if "loss" in row}

    theirs, ours = figures(reference_path), figures(other_path)
    problems = []
    for step in sorted(set(theirs) & set(ours)):
        for name in names:
            a, b = theirs[step].get(name), ours[step].get(name)
            if a is None or b is None or abs(a - b) > atol * max(1.0, abs(a)):
                problems.append(f"step {step}: {name} {a} vs {b} (allowed {atol:g} x max(1, |{a}|))")
    return problems
