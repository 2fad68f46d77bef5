"""Where a run's wall time goes: the goodput ledger.

The wall time of a launch (from the launcher taking the composed spec, runner.launch.start,
to the results being written; the interpreter's start and Hydra's composition before it
are not counted) is
split into parts that add up to it:

- startup: to the first training batch (validation, data preparation, model build,
  wrapping, a resume's loading, the first batch's wait);
- ray_startup, launch.engine=ray only: from connecting to (or starting) Ray to the first
  worker group's start, out of startup;
- reference: a preference run's reference log-probs, scored before training
  (preference.reference=precomputed; nothing when a resume reads them back);
- generation: online RL's sampling (train.objective=grpo): each generation batch's
  completions, and the log-probs scored on them before training (the policy's when later
  steps train on them, the reference's); an evaluation's samples count as evaluation;
- compile: torch.compile's compiling (model.compile), wherever it happened: the first
  steps, an evaluation's first batch, a recompilation;
- steps: the training loop's own time (forward, backward, optimizer, logging);
- data_wait: waiting for training batches after the first;
- evaluation: every evaluation, in the loop and at the end;
- checkpoint_saves: every checkpoint save, and writing model/ (or adapter/) at the end;
- lost_to_restarts: after a worker died and `launch.max_restarts` restarted the workers,
  the time from the checkpoint they resumed from (before the first checkpoint, from the
  dead attempt's first batch) to the new attempt's first batch: the work redone since
  plus the restart itself. An attempt that died before its first batch is lost whole.

Goodput is steps / wall. This module owns the arithmetic: the parts are added here (the
loop's steps are its own time less what it spent in the other parts), and `results`
totals them against the wall time; the trainer and the worker only say what happened,
and runner/report/ prints the figures it is given.

The launch's start is taken once, by runner.launch.start, and passed down as a value: to
the worker in this process, or as an argument of the spawned workers' entry
(runner.launch.launcher), which torch elastic hands to restarted workers unchanged, with
the attempt's number (`TORCHELASTIC_RESTART_COUNT`; under Ray Train, launch.engine=ray, the
launch's own `RUNNER_RESTART_COUNT`; `restarts` in the report). A run
handed no start (runner certify's runs in turn, a rank joined from an outside launch)
starts its own when the worker takes it. When the loop begins, and after each
checkpoint, rank 0 records the ledger so far (`ledger.json` in the run folder, with the
step a restart would start from); a restarted attempt that starts from that step in the
same launch carries those parts over and counts the rest as lost. A resume in a new
launch (resume=auto the next day) starts a new ledger: its wall time is its own.

From the measured save time and `launch.mtbf_hours`, the run suggests a checkpoint
interval by Young and Daly's rule: sqrt(2 x save time x MTBF).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torch elastic's, in every worker it starts
# The same count from a launch engine other than torch elastic (Ray Train: runner/launch/ray_engine.py)
ATTEMPT_ENV = "RUNNER_RESTART_COUNT"
LEDGER_FILENAME = "ledger.json"
PARTS = ("startup", "reference", "generation", "compile", "steps", "data_wait", "evaluation", "checkpoint_saves", "lost_to_restarts")
# A part only a launch engine's runs have: launch.engine=ray's start-up (connecting to or
# starting Ray, placing and starting the worker group), out of `startup`, booked by the
# first attempt from ENGINE_STARTUP_ENV (runner/launch/ray_engine.py sets it).
ENGINE_PARTS = ("ray_startup",)
ENGINE_STARTUP_ENV = "RUNNER_RAY_STARTUP_SECONDS"


def restart_count() -> int:
    """How many times the workers of this launch were restarted (launch.max_restarts):
    0 in the first attempt."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def process_started() -> float:
    """Wall clock at which this process started: a restarted attempt's own beginning."""
    import psutil  # Accelerate's dependency

    return float(psutil.Process().create_time())


@dataclass
class Ledger:
    launch: float  # wall clock of the launch's start
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    saves: int = 0  # checkpoint saves timed (for the mean save time)
    save_seconds: float = 0.0  # their time alone (checkpoint_saves also holds model/)
    resumed_at: Optional[float] = None  # a restart: when the point it started from was recorded
    first_step: int = 0  # the step this launch's first attempt started from
    restarts: int = 0  # which attempt this is (0: the first; torch elastic's restart count)
    attempt_start: Optional[float] = None  # a restarted attempt: when its process started

    def __post_init__(self) -> None:
        # The loop's own clock (not recorded): while it runs, its time less what went to the
        # other parts is its steps' time.
        self._loop_started: Optional[float] = None  # time.perf_counter() at its start
        self._loop_elsewhere = 0.0  # the loop's seconds booked to the other parts
        self._before_loop = 0.0  # seconds booked to other parts before the loop: not start-up's

    def add(self, part: str, seconds: float) -> None:
        """`seconds` went to `part` (during the loop: not to its steps)."""
        self.parts[part] = self.parts.get(part, 0.0) + max(seconds, 0.0)
        if self._loop_started is not None:
            self._loop_elsewhere += seconds
        elif part not in ("startup", "lost_to_restarts"):
            self._before_loop += max(seconds, 0.0)

    def start_loop(self) -> float:
        """The training loop starts now; returns time.perf_counter() at it."""
        self._loop_started, self._loop_elsewhere = time.perf_counter(), 0.0
        return self._loop_started

    def end_loop(self) -> None:
        """The loop is over: its steps' time is final."""
        self.parts = self.so_far().parts
        self._loop_started = None

    def so_far(self) -> "Ledger":
        """A copy with the loop's steps until now."""
        ledger = self.copy()
        if self._loop_started is not None:
            ledger.add("steps", time.perf_counter() - self._loop_started - self._loop_elsewhere)
        return ledger

    def begin(self, now: float, step: int) -> str:
        """The loop starts at wall clock `now`, at `step`: the time before it is start-up,
        or after a restart, lost since the point recorded. Returns the part the first
        batch's wait joins."""
        if self.resumed_at is not None:
            self.add("lost_to_restarts", now - self.resumed_at)
            return "lost_to_restarts"
        self.first_step = step
        started = self.launch
        if self.restarts and self.attempt_start is not None:
            # restarted, with nothing recorded: the attempts before died before their loop
            # began, so their time is lost; this attempt's own start-up is the start-up
            started = max(self.attempt_start, self.launch)
            self.add("lost_to_restarts", started - self.launch)
        self.add("startup", now - started - self._before_loop)
        return "startup"

    def results(self, last_step: int, save_every: int, mtbf_hours: Optional[float]) -> dict[str, Any]:
        """all_results.json's `goodput` entry at the end of the run: the wall time is the
        launch's until now (see `report`)."""
        return report(self, time.time() - self.launch, last_step, save_every, mtbf_hours)

    def add_save(self, seconds: float) -> None:
        self.add("checkpoint_saves", seconds)
        self.saves += 1
        self.save_seconds += max(seconds, 0.0)

    def snapshot(self, step: int) -> dict[str, Any]:
        return {**asdict(self), "step": step, "at": time.time()}

    def copy(self) -> "Ledger":
        return Ledger(self.launch, dict(self.parts), self.saves, self.save_seconds, self.resumed_at, self.first_step,
                      self.restarts, self.attempt_start)


def write_snapshot(run_dir: Path, ledger: Ledger, step: int) -> None:
    """Rank 0, when the loop begins and after a checkpoint is complete: the ledger up to
    it (the loop's steps so far included) and the step a restart would start from (atomic
    rename)."""
    tmp = run_dir / f".{LEDGER_FILENAME}.tmp"
    tmp.write_text(json.dumps(ledger.so_far().snapshot(step)))
    tmp.replace(run_dir / LEDGER_FILENAME)


def resumed(run_dir: Path, launch: float, step: int) -> Ledger:
    """The ledger of an attempt that starts from `step` (0, or the checkpoint it resumed):
    within the same launch (a restart), the parts recorded when an attempt before it
    began its loop or saved that checkpoint, the time since counted as lost when the
    loop begins; else a new ledger, marked with the attempt's number."""
    restarts = restart_count()
    ledger = Ledger(launch, restarts=restarts, attempt_start=process_started() if restarts else None)
    engine_startup = float(os.environ.get(ENGINE_STARTUP_ENV) or 0)
    if engine_startup and not restarts:  # a restart's is lost time, booked as such
        ledger.add(ENGINE_PARTS[0], engine_startup)
    try:
        saved = json.loads((run_dir / LEDGER_FILENAME).read_text())
    except (OSError, ValueError):
        return ledger
    if saved.get("launch") != launch or saved.get("step") != step:
        return ledger  # another launch's, or not the checkpoint resumed
    ledger.parts.update({k: float(v) for k, v in saved["parts"].items() if k in PARTS + ENGINE_PARTS})
    ledger.saves, ledger.save_seconds = int(saved["saves"]), float(saved["save_seconds"])
    ledger.first_step = int(saved.get("first_step", 0))
    ledger.resumed_at = float(saved["at"])
    return ledger


def suggested_interval(save_seconds: float, mtbf_hours: float) -> float:
    """Young/Daly: the checkpoint interval (seconds) that loses least to saves and failures."""
    return math.sqrt(2.0 * save_seconds * mtbf_hours * 3600.0)


def report(ledger: Ledger, wall: float, last_step: int, save_every: int, mtbf_hours: Optional[float]) -> dict[str, Any]:
    """all_results.json's `goodput` entry: the parts, their sum against the wall time, the
    goodput, and the checkpoint interval Young/Daly suggest from the measured save time
    and the steps' own time (evaluations and saves left out)."""
    steps_run = last_step - ledger.first_step
    step_seconds = ledger.parts["steps"] / steps_run if steps_run > 0 else None
    parts = {k: round(v, 3) for k, v in ledger.parts.items()}
    out: dict[str, Any] = {
        "wall_seconds": round(wall, 3),
        "parts_seconds": parts,
        "parts_sum_seconds": round(sum(ledger.parts.values()), 3),
        "goodput": round(ledger.parts["steps"] / wall, 4) if wall > 0 else None,
        "mean_save_seconds": round(ledger.save_seconds / ledger.saves, 3) if ledger.saves else None,
        "restarts": ledger.restarts,
    }
    if ledger.saves and mtbf_hours and step_seconds:
        interval = suggested_interval(ledger.save_seconds / ledger.saves, mtbf_hours)
        steps = max(1, round(interval / step_seconds))
        out["suggested_save_every"] = steps
        out["suggestion"] = (
            f"Young/Daly with a save of {ledger.save_seconds / ledger.saves:.2f} s and launch.mtbf_hours={mtbf_hours:g}: "
            f"a checkpoint every {interval:,.0f} s, about {steps:,} steps of {step_seconds:.3g} s"
            + (f"; train.save_every={save_every} is {save_every / steps:.2g}x that" if save_every else
               "; train.save_every=0 saves none"))
    return out
