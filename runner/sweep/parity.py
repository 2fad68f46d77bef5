"""A sweep's parity columns: every job's per-step loss and gradient norm against one baseline job.

A strategy sweep (`strategy=ddp,zero2,zero3`) should show, next to speed and memory,
whether each strategy still does the same math. runner/report/parity.py compares two runs;
this module picks the baseline job (`sweep.parity_baseline`), compares every other job
with it and says when no parity could be expected (dropout on). runner/sweep/summary.py only
appends the columns computed here to its table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from runner.components.adapters import adapter_dropout
from runner.components.model import build_config
from runner.config.errors import UserError
from runner.config.spec import RunSpec, load_spec
from runner.config.validate import parity_baseline_problems
from runner.distributed.strategies import build_strategy
from runner.report.parity import EQUAL_MATH, Numerics, Tolerance, parity_problems, parity_tolerance, step_records

PARITY_COLUMNS = ("max_abs_dloss", "max_grad_norm_rel_diff", "parity", "parity_detail")

# What to pass to switch GPT-2's dropout off; other models name theirs differently
# (dropout_settings finds any *pdrop / *dropout* value).
DROPOUT_OFF = "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


@dataclass(frozen=True)
class Job:
    """What the parity columns need to know of a sweep's job."""

    name: str  # its folder in the sweep folder
    overrides: str  # the overrides it ran with, space-separated
    ok: bool  # it finished


@dataclass(frozen=True)
class JobParity:
    max_abs_dloss: Optional[float] = None
    max_grad_norm_rel_diff: Optional[float] = None
    parity: str = "-"  # baseline | ok | FAILED | not expected | - (nothing to compare)
    parity_detail: Optional[str] = None


def pick_baseline(jobs: Sequence[Job], setting: Optional[str]) -> Job:
    """The job named by `sweep.parity_baseline`: null -> the first; digits -> that index
    in the sweep's job list (Hydra's job number; folders are named by a hash); else overrides, all of which the
    job must have been run with. Raises ValueError unless exactly one job matches."""
    if not jobs:
        raise ValueError("the sweep has no jobs")
    if setting is None:
        return jobs[0]
    problems = parity_baseline_problems(str(setting))
    if problems:
        raise ValueError(problems[0])
    text = str(setting).strip()
    if text.isdigit():
        index = int(text)
        if index >= len(jobs):
            raise ValueError(f"sweep.parity_baseline={text}: the sweep has jobs 0..{len(jobs) - 1}")
        return jobs[index]
    wanted = set(text.split())
    matches = [j for j in jobs if wanted <= set(j.overrides.split())]
    if len(matches) != 1:
        found = "no job" if not matches else f"{len(matches)} jobs ({', '.join(j.name for j in matches)})"
        raise ValueError(f"sweep.parity_baseline='{text}' matches {found}; it must name exactly one "
                         "(an index, or overrides of one job)")
    return matches[0]


def max_differences(
    reference: dict[int, dict[str, Optional[float]]], other: dict[int, dict[str, Optional[float]]]
) -> tuple[Optional[float], Optional[float]]:
    """(max |loss difference|, max relative gradient-norm difference) over the steps both logged."""
    steps = sorted(set(reference) & set(other))
    losses = [abs(reference[s]["loss"] - other[s]["loss"]) for s in steps
              if reference[s]["loss"] is not None and other[s]["loss"] is not None]
    norms = [abs(reference[s]["grad_norm"] - other[s]["grad_norm"]) / abs(reference[s]["grad_norm"]) for s in steps
             if reference[s]["grad_norm"] and other[s]["grad_norm"] is not None]
    return (max(losses) if losses else None, max(norms) if norms else None)


def _is_dropout_key(key: str) -> bool:
    # GPT-2's summary_first_dropout belongs to its classification head, unused by a causal LM.
    return (key.endswith("pdrop") or "dropout" in key) and not key.startswith(("summary_", "classifier"))


def dropout_settings(model_config: dict[str, Any]) -> dict[str, float]:
    """The non-zero dropout probabilities of a model config (as in config.json)."""
    return {k: float(v) for k, v in model_config.items()
            if _is_dropout_key(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def job_model_config(job_dir: Path) -> Optional[dict[str, Any]]:
    """The config the job's model was built with: its saved model/config.json, else the
    config its frozen run_spec.yaml describes; None when neither can be read."""
    saved = job_dir / "model" / "config.json"
    if saved.exists():
        return json.loads(saved.read_text())
    spec_path = job_dir / "run_spec.yaml"
    if not spec_path.exists():
        return None

    try:
        return build_config(load_spec(spec_path).model).to_dict()
    except (UserError, OSError, ValueError):
        return None


def job_dropout(job_dir: Path) -> dict[str, float]:
    """The job's dropout: its model's, and its adapters' (peft.dropout) from its run_spec.yaml."""
    dropout = dropout_settings(job_model_config(job_dir) or {})
    try:
        return {**dropout, **adapter_dropout(load_spec(job_dir / "run_spec.yaml").peft)}
    except (UserError, OSError, ValueError):
        return dropout


def job_world_size(job_dir: Path, spec: RunSpec) -> str:
    """The processes the job ran: one peak per rank in its results, else what its spec
    says (launch.nproc_per_node may be auto there, resolved on the machine it ran on)."""
    try:
        return str(len(json.loads((job_dir / "all_results.json").read_text())["peak_memory_mb_per_rank"]))
    except (OSError, ValueError, KeyError, TypeError):
        nproc = str(spec.launch.nproc_per_node)
        return str(int(nproc) * spec.launch.nnodes) if nproc.isdigit() else f"{nproc}x{spec.launch.nnodes} nodes"


def job_numerics(job_dir: Path) -> Numerics:
    """The job's precision, what it means under its strategy, and its layout, from its
    frozen run_spec.yaml; blank when that cannot be read (the equal-math tolerance applies)."""
    try:
        spec = load_spec(job_dir / "run_spec.yaml")
        strategy = build_strategy(spec.strategy, spec.precision)
        t = spec.train
        layout = f"{job_world_size(job_dir, spec)}x{t.per_device_batch_size}x{t.grad_accum_steps}"
        return Numerics(spec.precision.kind.value, strategy.name, strategy.precision_policy(), layout)
    except (UserError, OSError, ValueError):
        return Numerics("", "", "")


def baseline_setting(sweep_dir: Path, jobs: Sequence[Job]) -> Optional[str]:
    """`sweep.parity_baseline` as the jobs' frozen specs hold it (the same in every job)."""
    for job in jobs:
        path = sweep_dir / job.name / "run_spec.yaml"
        if path.exists():
            return load_spec(path).sweep.parity_baseline
    return None


def _compare(sweep_dir: Path, job: Job, reference: dict, baseline_dropout: dict[str, float],
             tolerance: Tolerance) -> JobParity:
    metrics = sweep_dir / job.name / "metrics.jsonl"
    if not job.ok or not metrics.exists():
        return JobParity()
    other = step_records(metrics)
    dloss, drel = max_differences(reference, other)
    dropout = {**baseline_dropout, **job_dropout(sweep_dir / job.name)}
    if dropout:
        shown = ", ".join(f"{k}={v:g}" for k, v in sorted(dropout.items()))
        return JobParity(dloss, drel, "not expected", f"dropout on ({shown}): each layout draws its own masks")
    problems = parity_problems(reference, other, tolerance.loss_atol, tolerance.grad_norm_rtol)
    # A looser tolerance is named in the verdict itself, pass or fail, with its reason.
    looser = None if tolerance is EQUAL_MATH else f"bf16 tolerance ({tolerance.describe()}): {tolerance.why}"
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return JobParity(dloss, drel, "FAILED", problems[0] + more + (f"; {looser}" if looser else ""))
    return JobParity(dloss, drel, "ok", looser)


def sweep_parity(sweep_dir: Path, jobs: Sequence[Job], setting: Optional[str]) -> tuple[dict[str, JobParity], list[str]]:
    """The parity columns of every job, and the notes summary.md prints under the table."""
    if not jobs:
        return {}, []
    try:
        baseline = pick_baseline(jobs, setting)
    except ValueError as err:
        return {}, [f"No parity columns: {err}."]
    baseline_metrics = sweep_dir / baseline.name / "metrics.jsonl"
    if not baseline.ok or not baseline_metrics.exists():
        return {}, [f"No parity columns: the baseline job {baseline.name} has no per-step metrics (status not ok)."]
    reference = step_records(baseline_metrics)
    baseline_dropout = job_dropout(sweep_dir / baseline.name)
    baseline_numerics = job_numerics(sweep_dir / baseline.name)
    columns = {baseline.name: JobParity(0.0, 0.0, "baseline")}
    looser: dict[str, Tolerance] = {}
    for job in jobs:
        if job.name != baseline.name:
            tolerance = parity_tolerance(job_numerics(sweep_dir / job.name), baseline_numerics)
            if tolerance is not EQUAL_MATH:
                looser[job.name] = tolerance
            columns[job.name] = _compare(sweep_dir, job, reference, baseline_dropout, tolerance)
    notes = [
        f"Parity: each job's loss and gradient norm at every logged step against job {baseline.name}"
        f" ({baseline.overrides or 'no overrides'}); ok = {EQUAL_MATH.describe()} at every step"
        " (set the baseline with sweep.parity_baseline)."
    ]
    if looser:
        tolerance = next(iter(looser.values()))
        notes.append(
            f"Jobs {', '.join(looser)} ran bf16 under another strategy or in another layout than the baseline, so "
            f"they are held to {tolerance.describe()} instead: bf16 is different numerics per strategy (ddp "
            "autocasts over fp32 weights, zero2/zero3 run the whole module in bf16, fsdp gathers bf16 parameters; "
            "each run_spec.yaml says which), and another layout rounds to bf16 after summing in another order; "
            "those differ by bf16 rounding from the first step. For a strict comparison, sweep strategies and "
            "layouts in fp32."
        )
    unexpected = [name for name, p in columns.items() if p.parity == "not expected"]
    if unexpected:
        notes.append(
            f"Dropout was on (jobs {', '.join(unexpected)}), so no parity was expected: each layout draws its own "
            f"dropout masks. For a parity sweep switch it off, adding {DROPOUT_OFF} to model.config_overrides, e.g. "
            f"'model.config_overrides=\"n_embd=64,n_layer=2,n_head=2,n_positions=128,{DROPOUT_OFF}\"'."
        )
    return columns, notes
