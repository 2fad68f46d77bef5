"""Do two runs do the same math? Per-step loss and gradient norm, compared.

The loss alone is a weak witness: AdamW with clipping barely moves when a gradient is
off by a constant factor (say, an accumulation division skipped), and the first
warm-up step runs at lr 0. The gradient norm, read before clipping, shows such a
factor at once. So both are compared at every logged step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

# Equal math in another layout differs only by float summation order: measured within
# 2e-6 on the loss over 20 steps (DESIGN.md); the norm gets a relative allowance.
LOSS_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-3


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
            problems.append(f"step {step}: grad_norm {ga:.6g} vs {gb:.6g} ({abs(ga - gb) / abs(ga):.2%} apart, "
                            f"allowed {grad_norm_rtol:.1%})")
    return problems
