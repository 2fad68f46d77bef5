"""One job of a Hydra multirun: what it does in a continued sweep (keep, resume, re-run,
run), running it, and recording how it ended (job_status.json, .sweep_runs/), so a
failed job is recorded with its reason and the sweep goes on.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config.errors import RunFailed, UserError
from runner.config.spec import RunSpec
from runner.distributed.world import world_size
from runner.launch.start import start
from runner.sweep.resume import Action, continue_command, has_results, plan_job, result_changes, write_record
from runner.sweep.status import job_reason, job_status, write_job_status
from runner.train.signals import EXIT_CODES, held_signal, hold_again


def run_sweep_job(make_spec: Callable[[], RunSpec], job_dir: Path, sweep_dir: Path, num: int, overrides: list[str],
                  composed: Any, run_dir_chosen: bool) -> None:
    """Run one sweep job; a failure is recorded in its folder and does not end the sweep."""
    started = time.perf_counter()
    action = None
    objective = composed_objective(composed)
    try:
        spec = make_spec()
        action = plan_sweep_job(spec, job_dir, sweep_dir, num)
        if action is None:
            return  # kept: its folder already holds its results
        start(spec, job_dir, spec.overwrite, composed, tuple(overrides), run_dir_chosen)
    except SystemExit as stop:
        if stop.code in EXIT_CODES.values():  # a signal: the sweep stops here, resumable
            sweep_stopped(stop, job_dir, sweep_dir, num, action, time.perf_counter() - started, overrides)
            raise
        # The job ended itself (a non-finite loss: TrainingStopped): recorded, and the next job runs.
        reason = getattr(stop, "reason", None) or f"the job exited with code {stop.code}"
        sys.stderr.write(f"runner: job {num} failed: {reason}\n")
        write_job_status(job_dir, "failed", time.perf_counter() - started, overrides, reason, objective)
        return
    except Exception as err:  # UserError, RunFailed, or a crash: recorded, and the next job runs
        reason = "; ".join(err.problems) if isinstance(err, UserError) else f"{type(err).__name__}: {err}".splitlines()[0]
        sys.stderr.write(f"runner: job {num} failed: {reason}\n")
        if isinstance(err, UserError) and action is Action.resumed:
            # Refused before it wrote anything: its folder (and checkpoints) stay as they
            # were, to be continued once the spec is put back.
            write_record(sweep_dir, job_dir, num, action, "refused", reason)
            return
        write_job_status(job_dir, "failed", time.perf_counter() - started, overrides, reason, objective)
        if not isinstance(err, (UserError, RunFailed)):
            traceback.print_exc()
        return
    write_job_status(job_dir, "ok", time.perf_counter() - started, overrides, objective=objective)


def composed_objective(composed: Any) -> Optional[str]:
    """train.objective as Hydra composed the job (None: not readable there)."""
    if not OmegaConf.is_config(composed):
        return None
    try:
        value = OmegaConf.select(composed, "train.objective")
    except OmegaConfBaseException:  # an interpolation that does not resolve: no objective to report
        return None
    return None if value is None else str(getattr(value, "value", value))


def plan_sweep_job(spec: Any, job_dir: Path, sweep_dir: Path, num: int) -> Optional["Action"]:
    """A sweep job's part in a continued sweep: its Action, or None when it is kept.
    Records what it does; a refused job is recorded and its folder left alone."""
    hold_again()
    held = held_signal()
    if held is not None:  # taken between jobs: start no more
        raise SystemExit(EXIT_CODES.get(signal.Signals(held), 1))
    if spec.resume != "auto":
        # A plain sweep: begin_sweep let it start only into an empty folder or with overwrite=true.
        action = Action.rerun if spec.overwrite and has_results(job_dir) else Action.new
        write_record(sweep_dir, job_dir, num, action)
        return action
    try:
        action = plan_job(job_dir, spec, world_size(spec.launch))
    except UserError as err:
        write_record(sweep_dir, job_dir, num, Action.kept, "refused", "; ".join(err.problems))
        sys.stderr.write(f"runner: job {num} refused: {'; '.join(err.problems)}\n")
        return None
    if action is Action.not_retried:
        reason = job_reason(job_dir) or "no reason recorded"
        write_record(sweep_dir, job_dir, num, action, "failed", reason)
        sys.stderr.write(f"runner: job {num} ({job_dir.name}) failed last time and is not retried: {reason} "
                         "(sweep.retry_failed=true retries it from its last checkpoint)\n")
        return None
    why = None
    if job_status(job_dir) == "ok" and action in (Action.resumed, Action.rerun):  # a finished job, not kept
        why = "finished under other settings: " + "; ".join(result_changes(job_dir, spec, world_size(spec.launch)))
    write_record(sweep_dir, job_dir, num, action, reason=why)
    sys.stderr.write(f"runner: job {num} ({job_dir.name}): {action.value}{f' ({why})' if why else ''}\n")
    return None if action is Action.kept else action


def sweep_stopped(
    stop: SystemExit, job_dir: Path, sweep_dir: Path, num: int, action: Optional["Action"], wall_s: float,
    overrides: list[str],
) -> None:
    """A signal stopped a local sweep: say so in the job's folder and print the command
    that continues the whole sweep."""
    signum = {code: sig for sig, code in EXIT_CODES.items()}.get(stop.code)  # type: ignore[arg-type]
    if signum is None:
        return
    if action is not None:  # the job had started: it checkpointed and stopped
        write_job_status(job_dir, "stopped", wall_s, overrides, f"stopped by {signal.Signals(signum).name}")
        write_record(sweep_dir, job_dir, num, action, "stopped")
    sys.stderr.write(
        f"runner: sweep stopped by {signal.Signals(signum).name} (job {num}, {job_dir.name}). Continue it with:\n"
        f"  {continue_command(sys.argv[1:], sweep_dir)}\n"
    )
