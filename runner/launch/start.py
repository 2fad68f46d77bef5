"""Start a run from a composed spec: settle the launch, validate everything at once,
claim the run folder, freeze run_spec.yaml, launch the workers, and turn how they
ended into one line. Shared by `runner ...` (Hydra), `runner --spec` and each sweep job.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from runner.components.data.stream import StreamedData
from runner.config.batch import accumulation_for
from runner.config.errors import USAGE_EXIT_CODE, RunFailed, UserError
from runner.config.spec import RunSpec, StrategyKind
from runner.config.validate import check_launch
from runner.distributed.process_group import slurm_node_launch
from runner.distributed.world import world_size
from runner.launch import auto_batch, failure_notes, fit
from runner.launch.accelerate_config import apply_accelerate_config
from runner.launch.dry_run import report
from runner.launch.elastic import freeze_global_batch
from runner.launch.launcher import launch, start_server_early
from runner.launch.preflight import check_stream_step, prepare_data, validate
from runner.launch.rundir import continues_in_place, freeze, prepare_run_dir
from runner.train.resume import ResumePlan, check_resume, start_branch
from runner.train.signals import EXIT_CODES


def apply_slurm_nodes(spec: Any) -> None:
    """srun with one task per node: each task is this node's launcher."""
    found = slurm_node_launch()
    if found and spec.launch.nnodes == 1:
        spec.launch.nnodes, spec.launch.node_rank, endpoint = found
        spec.launch.rdzv_endpoint = spec.launch.rdzv_endpoint or endpoint


def start(
    spec: RunSpec,
    run_dir: Path,
    overwrite: bool,
    composed: Any = None,
    overrides: tuple[str, ...] = (),
    run_dir_chosen: bool = True,
) -> None:
    """Validate, claim the run folder, freeze the spec, launch. Used by `runner ...`,
    `runner --spec` and each sweep job."""
    launched = time.time()  # the goodput ledger's wall time starts here (runner/train/ledger.py)
    start_server_early(spec)
    spec_path = claim(spec, run_dir, overwrite, composed, overrides, run_dir_chosen)
    if spec_path is not None:
        with launch_failures(spec, run_dir):
            launch(spec, spec_path, launched)
        if spec.eval.tasks and spec.launch.node_rank == 0:  # in this process, once the workers have exited
            from runner.report.benchmarks import evaluate_and_show

            evaluate_and_show(spec, run_dir.resolve())


def settle_batch(spec: RunSpec, world: int) -> None:
    """train.global_batch_size decides the accumulation at this world size; an elastic run
    (launch.min_workers) keeps its global batch in the spec, for each group to derive its own."""
    spec.train.grad_accum_steps = accumulation_for(spec.train, world)[0]
    freeze_global_batch(spec, world)


def claim(
    spec: RunSpec,
    run_dir: Path,
    overwrite: bool,
    composed: Any = None,
    overrides: tuple[str, ...] = (),
    run_dir_chosen: bool = True,
) -> Optional[Path]:
    """Everything before the launch: settle the launch, validate, claim the run folder and
    freeze the spec. The frozen spec's path, or None when there is nothing to launch (a
    dry run, a finished run asked to resume)."""
    if spec.strategy.kind is StrategyKind.accelerate_config:
        if not spec.strategy.config_file:
            raise UserError("strategy=accelerate_config needs its file: add strategy.config_file=path/to/accelerate_config.yaml")
        for note in apply_accelerate_config(spec):
            sys.stderr.write(f"runner: note: {note}\n")
    apply_slurm_nodes(spec)
    if spec.run_dir and Path(spec.run_dir).resolve() != run_dir.resolve():
        raise UserError(f"run_dir={spec.run_dir} is set by the launcher, not by hand: choose the run folder with "
                        "hydra.run.dir=PATH (or --run-dir PATH with --spec).")
    spec.run_dir = str(run_dir.resolve())
    # After the accelerate-config and Slurm settings above; a bad launch.* value is
    # reported by validate with everything else, not met here as a traceback.
    world = world_size(spec.launch) if not check_launch(spec) else None
    auto = auto_batch.is_auto(spec)
    if auto:  # settled below, once the data's block size is known; 1 until then
        auto_batch.check_request(spec, world)
        spec.train.per_device_batch_size = 1
    if world is not None:
        settle_batch(spec, world)
    validate(spec, world)
    data = prepare_data(spec, world or 1)
    room = fit.budget(spec, world)
    planner = fit.Planner(spec, data.block_size, world, gpu=room.gpu)
    if spec.dry_run:
        if auto:
            print(f"runner: dry run: {auto_batch.propose(spec, planner, room, world)}")
        print(report(spec, data, world, planner, room))
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra made it; a dry run leaves nothing behind
        return None
    chosen = [auto_batch.choose(spec, planner, room, world, launch)] if auto else []
    if auto and isinstance(data, StreamedData):  # checked above at a micro-batch of 1
        check_stream_step(spec, world, data)
    for line in chosen:
        sys.stderr.write(f"runner: {line}\n")
    fit.check_fit(spec, planner, room)
    if spec.launch.nnodes > 1 and not run_dir_chosen:
        raise UserError(
            "a multi-node run needs the same run folder on every node: set hydra.run.dir=/shared/path "
            "(the same on every node's command line)."
        )
    samples = None if spec.data.streaming else len(data.train)  # a stream's length is unknown
    key = None if spec.data.streaming else data.cache_path.name  # which blocks the position indexes
    resume = (check_resume(spec, run_dir.resolve(), world, train_samples=samples, data_key=key)
              if spec.resume is not None else ResumePlan())
    if resume.finished:
        sys.stderr.write(f"runner: {resume.finished}\n")  # before anything is written: the folder stays byte-identical
        return None
    checkpoint, notes = resume.checkpoint, list(resume.notes)
    if spec.launch.node_rank > 0:
        # Node 0 owns the run folder; this node's workers only need the spec.
        spec_path = freeze(spec, Path(tempfile.mkdtemp(prefix=f"runner-node{spec.launch.node_rank}-")))
    else:
        # Only a resume from this folder's own checkpoint may write beside its results.
        continuing = continues_in_place(run_dir, checkpoint)
        why = ""
        if spec.resume is not None and not continuing:
            why = "; resume=auto found no checkpoint in it to continue from" if checkpoint is None else (
                f"; resume={spec.resume} is another folder's checkpoint")
        prepare_run_dir(run_dir, overwrite, continuing=continuing, why=why)
        if continuing:
            loaded, aside = start_branch(run_dir.resolve(), checkpoint, int(resume.marker["step"]))
            notes += [aside] if aside else []
            if loaded != checkpoint:  # brought back from a set-aside branch: the workers load it there
                spec.resume = str(loaded)
        spec_path = freeze(spec, run_dir, composed, overrides, notes=chosen)
    for note in notes:  # after the folder is claimed: a refused start prints no "starting fresh"
        sys.stderr.write(f"runner: {note}\n")
    return spec_path


@contextmanager
def launch_failures(spec: RunSpec, run_dir: Path) -> Iterator[None]:
    """How the workers ended, as one line: a signal (they checkpointed) or a failed rank."""
    try:
        yield
    except SignalException as err:
        # The launcher was signalled; the workers got it too and checkpointed.
        code = EXIT_CODES.get(signal.Signals(err.sigval), 1)
        sys.stderr.write(
            f"runner: stopped by {signal.Signals(err.sigval).name}. Resume with: runner --spec {run_dir / 'run_spec.yaml'} "
            f"--run-dir {run_dir} --resume auto\n"
        )
        raise SystemExit(code) from None
    except ChildFailedError as err:
        # The rank that failed first by its own account (runner/launch/failure_notes.py),
        # else torch elastic's record: a rank that died without raising left no note.
        noted = failure_notes.first(getattr(err, "failure_notes", []))
        if noted is not None:
            if noted.callstack:  # shown once, above the one-line reason
                sys.stderr.write(f"[rank {noted.rank}] {noted.callstack.rstrip()}\n")
            advice = abort_advice(spec.launch.timeout_minutes) if noted.signal == signal.SIGABRT else ""
            raise RunFailed(f"worker rank {noted.rank} failed: {noted.reason}{advice}") from None
        rank, failure = err.get_first_failure()
        # @record hands the failing rank's traceback to this process (the spawned rank
        # does not print it): shown once, above the one-line reason.
        callstack = failure_traceback(failure)
        if callstack:
            sys.stderr.write(f"[rank {rank}] {callstack.rstrip()}\n")
        raise RunFailed(f"worker rank {rank} failed: {failure_reason(failure, spec.launch.timeout_minutes)}") from None


def failure_traceback(failure: Any) -> str:
    """The traceback torch elastic's @record saved for a failed worker ('' when there is
    none: a UserError's one line, a signal, an abort)."""
    if failure.exitcode == USAGE_EXIT_CODE or not isinstance(failure.message, dict):
        return ""
    return str(failure.message.get("extraInfo", {}).get("py_callstack", ""))


def failure_reason(failure: Any, timeout_minutes: float) -> str:
    """One line on why a worker died, from torch elastic's ProcessFailure."""
    message = str(failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message)
    reason = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
    if failure.exitcode == USAGE_EXIT_CODE:  # a UserError on that rank, printed there as one line
        reason = f"exit code {failure.exitcode}"
    if failure.exitcode == -signal.SIGABRT:
        reason += abort_advice(timeout_minutes)
    return reason


def abort_advice(timeout_minutes: float) -> str:
    # NCCL's watchdog does not raise in Python when a collective outlives the process
    # group's timeout: it aborts the process.
    return (
        f". On GPUs this is how NCCL ends a collective that waited longer than "
        f"launch.timeout_minutes={timeout_minutes:g}: a rank is stuck or died. Rerun with launch.debug=true "
        "(NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL) or set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1 to see which collective each rank was in; raise launch.timeout_minutes "
        "if one step is legitimately that slow. See docs/gpus.md ('Reading a timeout')"
    )
