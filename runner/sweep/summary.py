"""Sweeps: each job's outcome, and the comparison table and plot at the end.

Hydra multirun runs every combination, each in its own folder. A job that fails
(refused config, out of memory, a crash) records why in `job_status.json` and the
sweep goes on. When the sweep ends (Hydra's `on_multirun_end` callback), or later
with `runner-report SWEEP_DIR`, the sweep folder gets summary.csv, summary.md and
loss_curves.png, and the table is printed. The `run` column says what this
invocation did with each job: new, kept, resumed or re-run (runner/sweep/resume.py).
Its parity columns (each job's per-step loss and gradient norm against a baseline
job) come from runner/sweep/parity.py. Its evaluation columns are the figures the jobs'
objectives (train.objective) say a summary shows (`Objective.summarised`: eval_loss and
perplexity for the causal LM, eval_loss and rewards/* for DPO).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

from runner.components.objectives import summarised_figures
from runner.config.errors import UserError, exit_with
from runner.config.spec import ObjectiveKind, TrainSpec
from runner.report.plots import read_metrics
from runner.sweep.parity import PARITY_COLUMNS, Job, JobParity, baseline_setting, sweep_parity
from runner.sweep.resume import begin_sweep, continue_command, read_records
from runner.sweep.status import JOB_STATUS
from runner.train.signals import hold_signals

# summary.csv's columns: these, the jobs' evaluation figures between them (figure_names), then parity's.
COLUMNS_BEFORE = ("job", "overrides", "status", "run", "train_loss")
COLUMNS_AFTER = ("tokens_per_s", "peak_memory_mb", "wall_s", "goodput", "reason")


@dataclass
class JobRow:
    job: str
    overrides: str
    status: str
    train_loss: Optional[float] = None
    # The evaluation figures the sweep's objectives summarise, by name (all_results.json's):
    # eval_loss and perplexity for the causal LM; eval_loss and rewards/* for DPO.
    figures: dict[str, Optional[float]] = field(default_factory=dict)
    tokens_per_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    wall_s: Optional[float] = None
    goodput: Optional[float] = None  # the job's steps over its wall time (runner/train/ledger.py)
    reason: Optional[str] = None
    run: Optional[str] = None  # new | kept | resumed | re-run, as this invocation recorded it


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    import yaml

    return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]


def job_objective(job_dir: Path) -> Optional[ObjectiveKind]:
    """The job's train.objective: its frozen run_spec.yaml's, else what its job_status.json
    recorded (a job refused before its spec was written); None when neither says."""
    import yaml

    readers = ((job_dir / "run_spec.yaml", lambda text: (yaml.safe_load(text) or {}).get("train", {}).get("objective")),
               (job_dir / JOB_STATUS, lambda text: json.loads(text).get("objective")))
    for path, read in readers:
        try:
            return ObjectiveKind(read(path.read_text()))
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
    return None


def figure_names(objectives: list[Optional[ObjectiveKind]]) -> list[str]:
    """The evaluation columns: each objective's summarised figures, in the jobs' order,
    once each; the default objective's when no job says which it ran."""
    known = [kind for kind in objectives if kind is not None] or [TrainSpec().objective]
    return list(dict.fromkeys(name for kind in known for name in summarised_figures(kind)))


def collect(sweep_dir: Path) -> list[JobRow]:
    rows = []
    records = read_records(sweep_dir)
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and (
        (p / JOB_STATUS).exists() or (p / "all_results.json").exists() or p.name in records)]
    # In job-list order; folders this invocation did not visit (an earlier sweep's) last.
    order = {name: int(r.get("num", 0)) for name, r in records.items()}
    jobs = sorted(jobs, key=lambda p: (p.name not in order, order.get(p.name, 0), len(p.name), p.name))
    results_of = {job_dir: json.loads((job_dir / "all_results.json").read_text())
                  if (job_dir / "all_results.json").exists() else {} for job_dir in jobs}
    # and a mixture's own validation loss of each source (data.mixture), as the jobs name them
    # and the benchmark scores of eval.tasks, a column per task metric (their standard errors stay in the files)
    names = figure_names([job_objective(job_dir) for job_dir in jobs]) + list(dict.fromkeys(
        key for results in results_of.values() for key in results if key.startswith("eval_loss/")
        or (key.startswith("benchmark/") and not key.endswith("_stderr"))))
    for job_dir in jobs:
        status = json.loads((job_dir / JOB_STATUS).read_text()) if (job_dir / JOB_STATUS).exists() else {}
        record = records.get(job_dir.name, {})
        results = results_of[job_dir]
        rows.append(JobRow(
            job=job_dir.name,
            # resume=/overwrite= say how a job was run, not what it is (as its folder name)
            overrides=" ".join(o for o in status.get("overrides") or _overrides(job_dir) if not o.startswith(("resume=", "overwrite="))),
            status=record.get("status") or status.get("status", "ok" if results else "unknown"),
            train_loss=results.get("train_loss"),
            figures={name: results.get(name) for name in names},  # none where the job's objective has none
            tokens_per_s=results.get("train_tokens_per_second"),
            peak_memory_mb=results.get("peak_memory_mb"),
            wall_s=status.get("wall_s"),
            goodput=(results.get("goodput") or {}).get("goodput"),
            reason=record.get("reason") or status.get("reason"),
            run=record.get("run"),
        ))
    return rows


def _varying(rows: list[JobRow]) -> dict[str, str]:
    """Label each job by the overrides that differ across the sweep."""
    sets = {r.job: r.overrides.split() for r in rows}
    common = set.intersection(*(set(v) for v in sets.values())) if sets else set()
    return {job: " ".join(o for o in ovr if o not in common) or job for job, ovr in sets.items()}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _parity_cells(p: JobParity) -> list[str]:
    verdict = p.parity if p.parity_detail is None or p.parity == "baseline" else f"{p.parity}: {p.parity_detail}"
    return [_cell(p.max_abs_dloss), "-" if p.max_grad_norm_rel_diff is None else f"{p.max_grad_norm_rel_diff:.3%}", verdict]


def _figure_columns(rows: list[JobRow]) -> list[str]:
    """The rows' figure names, in order, once each (collect gives every row the same);
    the default objective's for rows that hold none."""
    return list(dict.fromkeys(name for r in rows for name in r.figures)) or figure_names([])


def table(rows: list[JobRow], parity: Optional[dict[str, JobParity]] = None) -> str:
    labels = _varying(rows)
    parity = parity or {}
    figures = _figure_columns(rows)
    header = ["job", "overrides", "status", "run", "train loss", *(name.replace("_", " ") for name in figures),
              "tokens/s", "peak MB", "wall s", "goodput", "max abs Δloss", "max grad-norm rel diff", "parity"]
    body = [
        [r.job, labels[r.job], r.status if r.status == "ok" else f"{r.status}: {r.reason}",
         # A finished job that ran again says why it was not kept.
         f"{r.run}: {r.reason}" if r.status == "ok" and r.reason else _cell(r.run), _cell(r.train_loss),
         *(_cell(r.figures.get(name)) for name in figures), _cell(r.tokens_per_s), _cell(r.peak_memory_mb), _cell(r.wall_s),
         "-" if r.goodput is None else f"{r.goodput:.1%}", *_parity_cells(parity.get(r.job, JobParity()))]
        for r in rows
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def plot(rows: list[JobRow], sweep_dir: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = _varying(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for r in rows:
        points = [(m["step"], m["loss"]) for m in read_metrics(sweep_dir / r.job / "metrics.jsonl") if "loss" in m]
        if points:
            ax.plot(*zip(*points), label=labels[r.job], linewidth=1.3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss")
    ax.set_title(f"sweep {sweep_dir.name}")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def summarize(sweep_dir: Path, parity_baseline: Optional[str] = None) -> list[JobRow]:
    """parity_baseline: as sweep.parity_baseline; None reads it from the jobs' frozen specs."""
    rows = collect(sweep_dir)
    jobs = [Job(r.job, r.overrides, r.status == "ok") for r in rows]
    parity, notes = sweep_parity(sweep_dir, jobs, parity_baseline if parity_baseline is not None else baseline_setting(sweep_dir, jobs))
    figures = _figure_columns(rows)
    with (sweep_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*COLUMNS_BEFORE, *figures, *COLUMNS_AFTER, *PARITY_COLUMNS])
        writer.writeheader()
        for r in rows:
            fields = {k: v for k, v in asdict(r).items() if k != "figures"}
            writer.writerow({**fields, **r.figures, **asdict(parity.get(r.job, JobParity()))})
    text = table(rows, parity) + "".join(f"\n\n{note}" for note in notes)
    (sweep_dir / "summary.md").write_text(f"# Sweep {sweep_dir.name}\n\n{text}\n\n![loss curves](loss_curves.png)\n")
    plot(rows, sweep_dir, sweep_dir / "loss_curves.png")
    print(f"\nrunner: sweep summary ({sweep_dir})\n{text}")
    return rows


class SweepSummary(Callback):
    """Hydra callback: before the first job, guard the sweep folder; after the last
    job, write and print the sweep's summary."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            begin_sweep(Path(config.hydra.sweep.dir), config.get("resume"), bool(config.get("overwrite")))
        except UserError as err:
            exit_with(err)  # SystemExit: Hydra turns a callback's Exception into a warning and runs the jobs
        if str(config.hydra.launcher.get("_target_", "")).endswith("BasicLauncher"):
            # Local jobs run in this process: a signal between jobs stops the sweep
            # cleanly instead of killing it mid-setup. (Slurm jobs get their own.)
            hold_signals()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            rows = summarize(sweep_dir)
            failed = [r.job for r in rows if r.status != "ok"]
            if failed:
                argv = [a for a in sys.argv[1:] if not a.startswith("sweep.retry_failed=")]
                sys.stderr.write(
                    f"runner: {len(failed)} of {len(rows)} jobs failed: {', '.join(failed)} (reasons in summary.md). "
                    f"Retry them from their last checkpoints with:\n  {continue_command(argv, sweep_dir)} "
                    "sweep.retry_failed=true\n")
                raise SystemExit(1)


def report_main(argv: Optional[list[str]] = None) -> None:
    """`runner-report SWEEP_DIR`: rebuild a sweep's summary from its job folders."""
    parser = argparse.ArgumentParser(prog="runner-report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--parity-baseline", default=None,
                        help="the job to compare the others with, as sweep.parity_baseline (default: what the sweep ran with)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        sys.stderr.write(f"runner-report: error: no such folder '{args.sweep_dir}'. Give a sweep folder (hydra.sweep.dir).\n")
        raise SystemExit(2)
    rows = summarize(args.sweep_dir, args.parity_baseline)
    if not rows:
        sys.stderr.write(f"runner-report: error: '{args.sweep_dir}' holds no job folders.\n")
        raise SystemExit(2)
