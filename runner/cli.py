"""`runner`: compose once with Hydra, validate, freeze the spec, launch the workers.

Only this process runs Hydra; workers read run_spec.yaml.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

from runner.config.errors import USAGE_EXIT_CODE, RunFailed, UserError, compose_error, exit_with

if TYPE_CHECKING:
    from runner.sweep.resume import Action


def _offline_defaults() -> None:
    # datasets/transformers otherwise probe the network on every load; a machine
    # that cannot reach the hub should not wait on it (validation says what to do).
    from runner.components.model import hub_reachable

    if "HF_HUB_OFFLINE" not in os.environ and not hub_reachable(timeout_s=2.0):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def refuse(err: UserError) -> NoReturn:
    """Exit 2 with one clear message; as rank 0 of a joined launch, tell the others first."""
    from runner.distributed.process_group import joined_launch

    joined = joined_launch()
    if joined is not None and joined.rank == 0:
        from runner.distributed.process_group import broadcast_text, init_process_group

        init_process_group()
        broadcast_text(None)
    exit_with(err)


def report_failed_run(err: RunFailed) -> NoReturn:
    """Exit 1 with one line; the failing rank's traceback was already printed above."""
    sys.stderr.write(f"runner: {err}; its error is shown above.\n")
    raise SystemExit(1) from None


def _apply_slurm_nodes(spec: Any) -> None:
    """srun with one task per node: each task is this node's launcher."""
    from runner.distributed.process_group import slurm_node_launch

    found = slurm_node_launch()
    if found and spec.launch.nnodes == 1:
        spec.launch.nnodes, spec.launch.node_rank, endpoint = found
        spec.launch.rdzv_endpoint = spec.launch.rdzv_endpoint or endpoint


def start(
    spec: Any,
    run_dir: Path,
    overwrite: bool,
    composed: Any = None,
    overrides: tuple[str, ...] = (),
    run_dir_chosen: bool = True,
) -> None:
    """Validate, claim the run folder, freeze the spec, launch. Shared by both entries."""
    import signal
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runner.launch.accelerate_config import apply_accelerate_config
    from runner.launch.launcher import launch, world_size
    from runner.train.resume import check_resume
    from runner.launch.rundir import continues_in_place, freeze, prepare_run_dir
    from runner.train.signals import EXIT_CODES
    from runner.config.spec import StrategyKind
    from runner.config.validate import check_blocks, check_launch, validate

    if spec.strategy.kind is StrategyKind.accelerate_config:
        if not spec.strategy.config_file:
            raise UserError("strategy=accelerate_config needs its file: add strategy.config_file=path/to/accelerate_config.yaml")
        for note in apply_accelerate_config(spec):
            sys.stderr.write(f"runner: note: {note}\n")
    _apply_slurm_nodes(spec)
    if spec.run_dir and Path(spec.run_dir).resolve() != run_dir.resolve():
        raise UserError(f"run_dir={spec.run_dir} is set by the launcher, not by hand: choose the run folder with "
                        "hydra.run.dir=PATH (or --run-dir PATH with --spec).")
    spec.run_dir = str(run_dir.resolve())
    # After the accelerate-config and Slurm settings above; a bad launch.* value is
    # reported by validate with everything else, not met here as a traceback.
    world = world_size(spec.launch) if not check_launch(spec) else None
    validate(spec, world)
    data = check_blocks(spec)
    if spec.dry_run:
        from runner.launch.dry_run import report

        print(report(spec, data, world))
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # Hydra made it; a dry run leaves nothing behind
        return
    if spec.launch.nnodes > 1 and not run_dir_chosen:
        raise UserError(
            "a multi-node run needs the same run folder on every node: set hydra.run.dir=/shared/path "
            "(the same on every node's command line)."
        )
    checkpoint, notes = (
        check_resume(spec, run_dir.resolve(), world, train_samples=len(data.train)) if spec.resume is not None else (None, [])
    )
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
        spec_path = freeze(spec, run_dir, composed, overrides)
    for note in notes:  # after the folder is claimed: a refused start prints no "starting fresh"
        sys.stderr.write(f"runner: {note}\n")
    try:
        launch(spec, spec_path)
    except SignalException as err:
        # The launcher was signalled; the workers got it too and checkpointed.
        code = EXIT_CODES.get(signal.Signals(err.sigval), 1)
        sys.stderr.write(
            f"runner: stopped by {signal.Signals(err.sigval).name}. Resume with: runner --spec {run_dir / 'run_spec.yaml'} "
            f"--run-dir {run_dir} --resume auto\n"
        )
        raise SystemExit(code) from None
    except ChildFailedError as err:
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
    import signal

    message = str(failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message)
    reason = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
    if failure.exitcode == USAGE_EXIT_CODE:  # a UserError on that rank, printed there as one line
        reason = f"exit code {failure.exitcode}"
    if failure.exitcode == -signal.SIGABRT:
        # NCCL's watchdog does not raise in Python when a collective outlives the process
        # group's timeout: it aborts the process, so there is no traceback to show.
        reason += (
            f". On GPUs this is how NCCL ends a collective that waited longer than "
            f"launch.timeout_minutes={timeout_minutes:g}: a rank is stuck or died. Rerun with launch.debug=true "
            "(NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL) or set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and "
            "TORCH_NCCL_DUMP_ON_TIMEOUT=1 to see which collective each rank was in; raise launch.timeout_minutes "
            "if one step is legitimately that slow. See the README section 'On GPUs'"
        )
    return reason


def _hydra_task(cfg: Any) -> None:
    import time

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from runner.config.spec import to_spec
    from runner.sweep.summary import write_job_status

    hydra_cfg = HydraConfig.get()
    chosen = any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in hydra_cfg.overrides.hydra)
    job_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    started = time.perf_counter()
    action = None
    try:
        try:
            spec = to_spec(cfg)
        except OmegaConfBaseException as err:  # e.g. a mandatory value (???) left unset
            raise compose_error(err) from None
        if sweeping:
            action = _sweep_job(spec, job_dir, Path(hydra_cfg.sweep.dir), int(hydra_cfg.job.num))
            if action is None:
                return  # kept: its folder already holds its results
        start(spec, job_dir, spec.overwrite, cfg, tuple(hydra_cfg.overrides.task), chosen)
    except SystemExit as stop:
        if sweeping:
            _sweep_stopped(stop, job_dir, Path(hydra_cfg.sweep.dir), int(hydra_cfg.job.num), action,
                           time.perf_counter() - started, list(hydra_cfg.overrides.task))
        raise
    except Exception as err:  # UserError, RunFailed, or a crash
        if not sweeping:
            if isinstance(err, UserError):
                refuse(err)  # exit here: Hydra would print "Error executing job" first
            if isinstance(err, RunFailed):
                report_failed_run(err)
            raise
        # In a sweep a failed job is recorded, and the next job runs.
        reason = "; ".join(err.problems) if isinstance(err, UserError) else f"{type(err).__name__}: {err}".splitlines()[0]
        sys.stderr.write(f"runner: job {hydra_cfg.job.num} failed: {reason}\n")
        from runner.sweep.resume import Action, write_record

        if isinstance(err, UserError) and action is Action.resumed:
            # Refused before it wrote anything: its folder (and checkpoints) stay as they
            # were, to be continued once the spec is put back.

            write_record(Path(hydra_cfg.sweep.dir), job_dir, int(hydra_cfg.job.num), action, "refused", reason)
            return
        write_job_status(job_dir, "failed", time.perf_counter() - started, list(hydra_cfg.overrides.task), reason)
        if not isinstance(err, (UserError, RunFailed)):
            import traceback

            traceback.print_exc()
        return
    if sweeping:
        write_job_status(job_dir, "ok", time.perf_counter() - started, list(hydra_cfg.overrides.task))


def _sweep_job(spec: Any, job_dir: Path, sweep_dir: Path, num: int) -> Optional["Action"]:
    """A sweep job's part in a continued sweep: its Action, or None when it is kept.
    Records what it does; a refused job is recorded and its folder left alone."""
    import signal

    from runner.launch.launcher import world_size
    from runner.train.signals import EXIT_CODES, hold_again, held_signal
    from runner.sweep.resume import Action, plan_job, write_record

    hold_again()
    held = held_signal()
    if held is not None:  # taken between jobs: start no more
        raise SystemExit(EXIT_CODES.get(signal.Signals(held), 1))
    if spec.resume != "auto":
        # A plain sweep: begin_sweep let it start only into an empty folder or with overwrite=true.
        from runner.sweep.resume import has_results

        action = Action.rerun if spec.overwrite and has_results(job_dir) else Action.new
        write_record(sweep_dir, job_dir, num, action)
        return action
    try:
        action = plan_job(job_dir, spec, world_size(spec.launch))
    except UserError as err:
        write_record(sweep_dir, job_dir, num, Action.kept, "refused", "; ".join(err.problems))
        sys.stderr.write(f"runner: job {num} refused: {'; '.join(err.problems)}\n")
        return None
    write_record(sweep_dir, job_dir, num, action)
    sys.stderr.write(f"runner: job {num} ({job_dir.name}): {action.value}\n")
    return None if action is Action.kept else action


def _sweep_stopped(
    stop: SystemExit, job_dir: Path, sweep_dir: Path, num: int, action: Optional["Action"], wall_s: float,
    overrides: list[str],
) -> None:
    """A signal stopped a local sweep: say so in the job's folder and print the command
    that continues the whole sweep."""
    import signal

    from runner.train.signals import EXIT_CODES
    from runner.sweep.summary import write_job_status
    from runner.sweep.resume import continue_command, write_record

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


def _run_spec_file(argv: list[str]) -> None:
    """`runner --spec RUN_DIR/run_spec.yaml`: re-run a frozen spec, no Hydra."""
    import datetime

    from runner.config.store import short_hash
    from runner.config.spec import load_spec

    parser = argparse.ArgumentParser(prog="runner --spec", description="Re-run a frozen run_spec.yaml.")
    parser.add_argument("--spec", required=True, type=Path, help="path to a run_spec.yaml")
    parser.add_argument("--run-dir", type=Path, default=None, help="output folder (default: a new one under outputs/)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --run-dir")
    parser.add_argument("--resume", default=None, help="auto (newest complete checkpoint in --run-dir) or a checkpoint path")
    args = parser.parse_args(argv)
    if not args.spec.is_file():
        raise UserError(f"--spec {args.spec}: no such file. Give the run_spec.yaml of an earlier run.")
    try:
        spec = load_spec(args.spec)
    except Exception as err:  # schema violations in a hand-edited file
        raise compose_error(err) from None
    if args.resume is not None:
        spec.resume = args.resume
    spec.run_dir = ""  # the frozen run's folder: --run-dir (or a new folder) takes its place
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dir = args.run_dir or Path("outputs") / spec.name / f"{stamp}_{short_hash(args.spec.read_text())}"
    start(spec, run_dir, args.overwrite or spec.overwrite, run_dir_chosen=args.run_dir is not None)


def _follow() -> None:
    """Rank > 0 of a torchrun / accelerate launch / srun launch: no Hydra, rank 0's spec."""
    from runner.launch.launcher import prepare_environment
    from runner.train.worker import run

    prepare_environment(1)
    run(None)


def main(argv: Optional[list[str]] = None) -> None:
    # Back torch's large CPU tensors (logits over a 50k vocabulary) with huge pages:
    # measured 27% faster steps for the tiny GPT-2, from ~200k to ~6k page faults a
    # step. Read by torch at its first allocation, and inherited by spawned workers.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from runner.distributed.process_group import joined_launch

    argv = sys.argv[1:] if argv is None else argv
    _offline_defaults()
    joined = joined_launch()
    try:
        if argv[:1] == ["env"]:
            from runner.report.env_report import main as env_main

            env_main()
        elif joined is not None and joined.rank != 0:
            _follow()
        elif any(a == "--spec" or a.startswith("--spec=") for a in argv):
            _run_spec_file(argv)
        else:
            _run_hydra(argv)
    except UserError as err:
        refuse(err)
    except RunFailed as err:
        report_failed_run(err)


def _run_hydra(argv: list[str]) -> None:
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.config.store import register
    from runner.config.paths import conf_dir

    # Let composition errors reach us as exceptions so we print one clear line
    # (and exit 2) instead of Hydra's report; training crashes keep their traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    register()
    task = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_hydra_task)
    sys.argv = [sys.argv[0], *argv]
    try:
        task()
    except UserError:
        raise
    except (HydraException, OmegaConfBaseException) as err:
        raise compose_error(err) from None


if __name__ == "__main__":
    main()
