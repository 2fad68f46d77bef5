"""`runner certify --recipes`: the usage runner was made for, run in full.

Every shipped recipe that runs offline (the embedded tokenizer and data, no hub model)
runs as a user runs a sweep, through the CLI in a process of its own: a two-step precision
sweep under the default strategy and another, `runner -m recipe=<recipe>
precision=fp32,bf16 strategy=ddp,zero2 train.max_steps=2 data.max_eval_samples=32`, each
job holding its recipe's data, model, reference, evaluation and saving as shipped. A job passes when it finished its two steps,
wrote all_results.json and ended its log with the summary. A recipe that needs the hub
(a connected one) is composed and validated offline, as its pre-flight does before any
download, and listed as such.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from runner.config.paths import recipes_dir
from runner.config.spec import RunSpec
from runner.config.validate import spec_problems

# Two steps, and the evaluation on 32 held-out rows (its code whole: the full split is minutes
# of a 2-core machine's time, the same forward many times over).
SWEEP = ("precision=fp32,bf16", "strategy=ddp,zero2", "train.max_steps=2", "data.max_eval_samples=32")
JOBS = [(strategy, precision) for strategy in ("ddp", "zero2") for precision in ("fp32", "bf16")]
SUMMARY_LINE = "runner: finished"


@dataclass
class RecipeRow:
    recipe: str
    offline: bool
    verdicts: dict[tuple[str, str], str] = field(default_factory=dict)  # (strategy, precision) -> verdict
    detail: list[str] = field(default_factory=list)


def shipped() -> list[str]:
    return sorted(path.stem for path in recipes_dir().glob("*.yaml"))


def offline(spec: RunSpec) -> bool:
    """No hub model and no hub dataset (in any mixture source): the recipe runs here."""
    model = spec.model.name_or_path
    datasets = [spec.data.dataset_name, *[s.dataset_name for s in spec.data.mixture or []]]
    return (model is None or Path(model).expanduser().exists()) and not any(datasets)


def job_verdict(job_dir: Path) -> tuple[str, Optional[str]]:
    """A sweep job's folder: finished (two steps, all_results.json, the summary in its log)
    or what is missing."""
    results, log = job_dir / "all_results.json", job_dir / "run.log"
    if not results.exists():
        return "failed", f"{job_dir.name}: no all_results.json"
    steps = json.loads(results.read_text()).get("train_steps")
    if steps != 2:
        return "failed", f"{job_dir.name}: train_steps {steps}, not 2"
    if not log.exists() or SUMMARY_LINE not in log.read_text():
        return "failed", f"{job_dir.name}: its log does not end with the summary"
    return "finished", None


def job_folders(sweep_dir: Path) -> dict[tuple[str, str], Path]:
    """Each job's folder by its (strategy, precision), read from its frozen spec."""
    from runner.config.spec import load_spec

    found = {}
    for spec_path in sweep_dir.glob("*/run_spec.yaml"):
        spec = load_spec(spec_path)
        found[(spec.strategy.kind.value, spec.precision.kind.value)] = spec_path.parent
    return found


def certify_recipe(recipe: str, work_dir: Path, compose: Callable[[Sequence[str]], RunSpec]) -> RecipeRow:
    spec = compose([f"recipe={recipe}"])
    row = RecipeRow(recipe, offline(spec))
    if not row.offline:
        problems = spec_problems(spec)
        verdict = "composed and validated offline" if not problems else "refused"
        row.verdicts = {job: verdict for job in JOBS}
        row.detail = problems
        return row
    sweep_dir = work_dir / recipe
    done = subprocess.run([sys.executable, "-m", "runner", "-m", f"recipe={recipe}", *SWEEP,
                           f"hydra.sweep.dir={sweep_dir}", f"data.cache_dir={work_dir / 'cache'}", "tracking=none"],
                          capture_output=True, text=True, timeout=1800)
    folders = job_folders(sweep_dir)
    for job in JOBS:
        if job not in folders:
            row.verdicts[job] = "failed"
            row.detail.append(f"{job[0]} {job[1]}: no job folder")
            continue
        row.verdicts[job], why = job_verdict(folders[job])
        if why:
            row.detail.append(why)
    if done.returncode != 0 and not row.detail:
        row.detail.append(f"the sweep exited {done.returncode}: {done.stderr[-500:]}")
        row.verdicts = {job: "failed" for job in JOBS}
    return row


def certify_recipes(work_dir: Path, recipes: Optional[Sequence[str]] = None) -> list[RecipeRow]:
    from runner.certify.matrix import compose

    return [certify_recipe(recipe, work_dir, compose) for recipe in (recipes or shipped())]


def render(rows: Sequence[RecipeRow], command: str) -> str:
    lines = [f"Made by `{command}`: each offline recipe as `runner -m recipe=<recipe> {' '.join(SWEEP)}`.", "",
             "| recipe | " + " | ".join(f"{s} {p}" for s, p in JOBS) + " |", "|---|" + "---|" * len(JOBS)]
    for row in rows:
        name = row.recipe if row.offline else f"{row.recipe} (connected)"
        lines.append(f"| {name} | " + " | ".join(row.verdicts[job] for job in JOBS) + " |")
    notes = [f"- {row.recipe}: {'; '.join(row.detail)}" for row in rows if row.detail]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def passed(rows: Sequence[RecipeRow]) -> bool:
    return all(v in ("finished", "composed and validated offline") for row in rows for v in row.verdicts.values())


def main(work_dir: Path, out: Optional[Path]) -> None:
    from runner.certify.matrix import publish

    rows = certify_recipes(work_dir)
    publish(render(rows, "runner certify --recipes"), out, passed(rows))
