"""`train.per_device_batch_size=auto`: the largest micro-batch that fits, at the global batch
the user gave. The plan proposes it (runner/launch/fit.py); a two-step probe run at that
micro-batch, in a scratch folder, on the same workers and strategy, confirms that its
measured peak stays within the budget (else the next smaller micro-batch is tried). The
accumulation is then derived from the global batch, so the learning-rate schedule and
the sample order (runner/components/data/prepare.py's sampler deals global batches) do not
depend on the choice: a resume on other hardware may choose again, as any layout change.

The probe runs no evaluation; the plan counts it (fit.Planner): an evaluation batch left
unset follows the micro-batch, so the one proposed evaluates within the budget too; a
given train.per_device_eval_batch_size is kept, and where it alone does not fit (what
evaluation holds does not depend on the micro-batch) auto refuses, naming the
evaluation batch that fits."""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from runner.config.batch import accumulation_for
from runner.config.errors import UserError
from runner.config.spec import RunSpec, TrackingKind, save_spec
from runner.launch.fit import Budget, Planner, decided, gib, nothing_fits
from runner.train.worker import PROBE_FILENAME

AUTO = "auto"
PROBE_STEPS = 2  # the second step is the first with AdamW's state allocated: the steady peak


def is_auto(spec: RunSpec) -> bool:
    return spec.train.per_device_batch_size == AUTO


def check_request(spec: RunSpec, world: Optional[int]) -> None:
    """auto keeps a global batch, so it needs one, and derives the accumulation from it
    (a given one would be checked against a placeholder micro-batch); one node (every
    node's launcher would have to probe in step)."""
    t, problems = spec.train, []
    if t.global_batch_size is None:
        problems.append("train.per_device_batch_size=auto keeps the global batch you give and picks the micro-batch: "
                        "set train.global_batch_size=<sequences per optimizer step> too.")
    if t.grad_accum_steps != 1:
        problems.append(f"train.per_device_batch_size=auto derives the accumulation from train.global_batch_size and "
                        f"the micro-batch it picks: remove train.grad_accum_steps={t.grad_accum_steps} (give only "
                        "train.global_batch_size).")
    elif world and t.global_batch_size is not None and t.global_batch_size % world:
        problems.append(f"train.global_batch_size={t.global_batch_size} does not divide among {world} processes. "
                        "Change train.global_batch_size or launch.nproc_per_node.")
    if spec.launch.min_workers is not None:  # every group size would have to hold the micro-batch it picks
        problems.append("train.per_device_batch_size=auto picks the micro-batch for one world size; an elastic run "
                        "(launch.min_workers) runs at several: give train.per_device_batch_size.")
    if spec.launch.nnodes > 1:
        problems.append("train.per_device_batch_size=auto runs on one node (its probe would have to run on every node "
                        "in step): plan the micro-batch with dry_run=true launch.device_memory=<GPU>, then set "
                        "train.per_device_batch_size by hand.")
    if problems:
        raise UserError(problems)


def set_micro_batch(spec: RunSpec, micro_batch: int, world: int) -> None:
    """The micro-batch, and the accumulation train.global_batch_size then implies."""
    t = spec.train
    t.per_device_batch_size, t.grad_accum_steps = micro_batch, 1
    t.grad_accum_steps = accumulation_for(t, world)[0]


def propose(spec: RunSpec, planner: Planner, room: Budget, world: int) -> str:
    """The dry run's choice: the plan's proposal, unconfirmed (no probe). Sets the spec."""
    t = spec.train
    strategy, share = spec.strategy.kind.value, t.global_batch_size // world
    proposed = planner.largest_micro_batch(strategy, share, room.bytes_per_rank)
    if proposed is None:
        return (f"train.per_device_batch_size=auto: no micro-batch is predicted to fit (see the plan below): "
                f"{nothing_fits(planner, strategy, share, room.bytes_per_rank)}")
    set_micro_batch(spec, proposed, world)
    return (f"train.per_device_batch_size=auto would choose {proposed} per device x {t.grad_accum_steps} accumulation "
            "(the plan's proposal; a real run confirms it with a two-step probe first)")


def probe_spec(spec: RunSpec, micro_batch: int, run_dir: Path) -> RunSpec:
    """The run at `micro_batch`, cut to PROBE_STEPS steps with at most two micro-batches a step
    (gradients held across a window's micro-batches are part of the peak), writing nothing
    but its metrics, in `run_dir`."""
    probe = copy.deepcopy(spec)
    t = probe.train
    t.per_device_batch_size, t.global_batch_size = micro_batch, None
    t.grad_accum_steps = min(spec.train.grad_accum_steps, 2)
    t.max_steps, t.log_every, t.eval_every, t.save_every = PROBE_STEPS, 1, 0, 0
    probe.data.max_eval_samples = 1
    probe.tracking, probe.resume, probe.run_dir, probe.overwrite = TrackingKind.none, None, str(run_dir), True
    probe.probe = True
    return probe


def measured_peak_bytes(run_dir: Path) -> float:
    """The largest rank's peak in the probe: CUDA max reserved on a GPU; on a CPU the peak
    RSS less what the process held before it built the model (the interpreter and
    libraries, which the plan, counting tensors, leaves out)."""
    probe = json.loads((run_dir / PROBE_FILENAME).read_text())
    peaks, befores = probe["peak_memory_mb_per_rank"], probe["host_memory_before_model_mb_per_rank"]
    if probe["device"] == "cpu":
        peaks = [p - b for p, b in zip(peaks, befores)]
    return max(peaks) * 2**20


def run_probe(spec: RunSpec, micro_batch: int, launch: Callable[[RunSpec, Path], None]) -> tuple[Optional[float], str]:
    """(measured peak in bytes, "") when the probe ran; (None, why) when it failed."""
    with tempfile.TemporaryDirectory(prefix="runner-auto-batch-") as tmp:
        run_dir = Path(tmp)
        probe = probe_spec(spec, micro_batch, run_dir)
        path = run_dir / "run_spec.yaml"
        save_spec(probe, path)
        try:
            launch(probe, path)
        except Exception as err:  # an out-of-memory error, a killed worker: this micro-batch does not run
            return None, str(err).splitlines()[0] if str(err) else type(err).__name__
        return measured_peak_bytes(run_dir), ""


def choose(spec: RunSpec, planner: Planner, room: Budget, world: int,
           launch: Callable[[RunSpec, Path], None]) -> str:
    """Set spec.train.per_device_batch_size and grad_accum_steps; return the line that says
    what was chosen and why."""
    t = spec.train
    share = t.global_batch_size // world
    strategy = spec.strategy.kind.value
    proposed = planner.largest_micro_batch(strategy, share, room.bytes_per_rank)
    if proposed is None:
        raise UserError(f"train.per_device_batch_size=auto: not even a micro-batch of 1 is predicted to fit in "
                        f"{gib(room.bytes_per_rank)} per rank on {room.described} under {strategy}: "
                        f"{nothing_fits(planner, strategy, share, room.bytes_per_rank)}.")
    candidates = [d for d in range(proposed, 0, -1) if share % d == 0]
    tried: list[str] = []
    for b in candidates:
        sys.stderr.write(f"runner: train.per_device_batch_size=auto: confirming micro-batch {b} with a "
                         f"{PROBE_STEPS}-step probe\n")
        peak, why = run_probe(spec, b, launch)
        if peak is not None and peak <= room.bytes_per_rank:
            set_micro_batch(spec, b, world)
            estimate = planner.estimate(strategy, b, t.grad_accum_steps)
            return (f"train.per_device_batch_size=auto chose {b} per device x {world} process(es) x "
                    f"{t.grad_accum_steps} accumulation = global batch {t.global_batch_size} (estimated peak "
                    f"{gib(estimate.device_total)}{decided(estimate)}, measured {gib(peak)}, of "
                    f"{gib(room.bytes_per_rank)} per rank"
                    + (f"; {', '.join(tried)}" if tried else "") + ")")
        tried.append(f"{b} failed ({why})" if peak is None else f"{b} measured {gib(peak)}, over")
    raise UserError(f"train.per_device_batch_size=auto: no micro-batch ran within {gib(room.bytes_per_rank)} per "
                    f"rank ({'; '.join(tried)}). Set train.per_device_batch_size by hand, or give "
                    "launch.device_memory.")
