"""Continuing a sweep: what each job does when the same sweep command runs again.

A job's folder is named by a hash of its own overrides (conf/config.yaml,
hydra.sweep.subdir), so a rerun finds it whatever the job's place in the job list.
With resume=auto each job is then:

- kept: it finished (job_status.json says ok). Nothing in its folder is touched.
- resumed: it was interrupted (killed, preempted, stopped by a signal) after a
  checkpoint; it continues from the newest one, checked like a single-run resume.
- not retried: it failed (a divergence, a crash, a killed worker). A deterministic
  failure would only repeat, so it is listed with its reason and left as it is, unless
  sweep.retry_failed=true: then it resumes from its newest complete checkpoint (or,
  without one or with overwrite=true, starts over).
- re-run: it was interrupted before its first checkpoint (or is a retried failure
  without one); it starts over.
- new: its folder holds nothing yet.

What each job did in this invocation goes into the sweep folder's .sweep_runs/, not
the job's folder, so a kept job's files stay byte-identical; the summary reads it.
"""

from __future__ import annotations

import json
import shlex
import shutil
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Sequence

from runner.config.errors import UserError
from runner.config.spec import SPEC_FILENAME, RunSpec, load_spec
from runner.launch.rundir import existing_results
from runner.sweep.status import JOB_STATUS, job_status
from runner.train.checkpoint import latest_checkpoint, read_marker
from runner.train.resume import compare, planned_total_steps

RECORDS_DIRNAME = ".sweep_runs"


class Action(str, Enum):
    new = "new"
    kept = "kept"
    resumed = "resumed"
    rerun = "re-run"
    not_retried = "not retried"


def has_results(job_dir: Path) -> bool:
    return (job_dir / JOB_STATUS).exists() or bool(existing_results(job_dir))


# Accepted by a resume (runner/train/resume_settings.py HARMLESS, HORIZON), yet they change what a finished
# job's results answer: a job finished under other values is not kept. The second line:
# the same math, but the summary's speed and memory columns measure them.
RESULT_DEFINING = ("train.max_steps", "train.num_epochs", "train.eval_every", "data.max_eval_samples",
                   "model.gradient_checkpointing", "model.compile", "model.attn_implementation",
                   "model.chunked_loss", "launch.retain_freed_memory", "strategy.reshard_after_forward")


def result_changes(job_dir: Path, spec: RunSpec, world: int) -> list[str]:
    """How this sweep's spec for a finished job differs from the one it ran with, in
    settings that change its results (empty: keep it). A change that breaks the math
    (a resume could not continue it either) is a UserError."""
    saved = job_dir / SPEC_FILENAME
    if not saved.is_file():
        return []  # finished before specs were frozen: nothing to compare against
    try:
        old = load_spec(saved)
    except Exception as err:
        raise UserError(f"job folder {job_dir}: its {SPEC_FILENAME} is unreadable ({err}).") from None
    newest = latest_checkpoint(job_dir)
    old_world = int(read_marker(newest).get("world_size", world)) if newest else world
    breaking, harmless = compare(old, spec, old_world, world)
    if breaking:
        raise UserError(
            f"job folder {job_dir} holds a finished job whose spec differs in ways that change its results: "
            f"{'; '.join(breaking)}. Undo them, or continue in a new hydra.sweep.dir=PATH."
        )
    return [h for h in harmless if h.startswith(tuple(f"{k}:" for k in RESULT_DEFINING))]


def _more_steps_only(job_dir: Path, spec: RunSpec, world: int, changes: list[str]) -> bool:
    """Whether only the step or epoch count changed, upwards: its newest checkpoint continues."""
    newest = latest_checkpoint(job_dir)
    if newest is None or not all(c.startswith(("train.max_steps:", "train.num_epochs:")) for c in changes):
        return False
    marker = read_marker(newest)
    total = planned_total_steps(spec, world, None, marker)
    return total is not None and total > int(marker["step"])


def plan_job(job_dir: Path, spec: RunSpec, world: int) -> Action:
    """What this job does in a continued sweep (resume=auto); sets spec.resume/overwrite
    to match. Raises UserError when a finished job's spec changed in a way that matters
    (an interrupted one is checked by the resume itself, runner/train/resume.py)."""
    status = job_status(job_dir)
    if status == "ok":
        changes = result_changes(job_dir, spec, world)
        if not changes:
            return Action.kept
        if _more_steps_only(job_dir, spec, world, changes):
            spec.resume = "auto"
            return Action.resumed  # finished under fewer steps: continued from its last checkpoint
        spec.resume, spec.overwrite = None, True
        return Action.rerun  # its results answer another question (summary: why)
    if not has_results(job_dir):
        spec.resume = None
        return Action.new
    if status == "failed" and not spec.sweep.retry_failed:
        return Action.not_retried
    if latest_checkpoint(job_dir) is not None and not (status == "failed" and spec.overwrite):
        spec.resume = "auto"
        return Action.resumed
    # Stopped before its first checkpoint, or a failure retried with overwrite=true: what it left is replaced.
    spec.resume, spec.overwrite = None, True
    return Action.rerun


def write_record(
    sweep_dir: Path, job_dir: Path, num: int, action: Optional[Action], status: Optional[str] = None,
    reason: Optional[str] = None,
) -> None:
    """This invocation's word on one job; `status`/`reason` only when the job's own
    folder cannot say it (a refused job's folder is left as it was)."""
    records = sweep_dir / RECORDS_DIRNAME
    records.mkdir(parents=True, exist_ok=True)
    record = {"num": num, "run": action.value if action else None, "status": status, "reason": reason}
    tmp = records / f"{job_dir.name}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(records / f"{job_dir.name}.json")


def read_records(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    records = sweep_dir / RECORDS_DIRNAME
    if not records.is_dir():
        return {}
    found = {}
    for path in records.glob("*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue
    return found


def jobs_with_results(sweep_dir: Path) -> list[str]:
    if not sweep_dir.is_dir():
        return []
    return sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and has_results(p))


def begin_sweep(sweep_dir: Path, resume: Optional[str], overwrite: bool) -> None:
    """At the start of a sweep (the launcher): refuse to clobber an earlier sweep's
    results unless told to continue or replace them; forget the last invocation's records."""
    found = jobs_with_results(sweep_dir)
    if found and resume != "auto" and not overwrite:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise UserError(
            f"the sweep folder {sweep_dir} already holds results of {len(found)} job(s) ({shown}). "
            "Continue that sweep with resume=auto (finished jobs are kept, interrupted ones resume), "
            "replace its results with overwrite=true, or pick a new hydra.sweep.dir=PATH."
        )
    shutil.rmtree(sweep_dir / RECORDS_DIRNAME, ignore_errors=True)


def _shell_word(word: str) -> str:
    # Hydra's own quoting (key='a,b') reads best inside double quotes; shlex's
    # all-single-quote form is kept for anything a shell would expand there.
    if shlex.quote(word) == word or any(c in word for c in '"$`\\!'):
        return shlex.quote(word)
    return f'"{word}"'


def continue_command(argv: Sequence[str], sweep_dir: Path) -> str:
    """The sweep's own command line, with resume=auto and its folder made explicit."""
    kept = [a for a in argv if not a.startswith(("resume=", "hydra.sweep.dir="))]
    return " ".join(_shell_word(w) for w in ["runner", *kept, "resume=auto", f"hydra.sweep.dir={sweep_dir.resolve()}"])
