"""`runner`: the entry. Parse, dispatch, close.

Only this process runs Hydra (compose once); `runner --spec` re-runs a frozen spec
without it; ranks > 0 of an outside launch (torchrun, accelerate launch, srun) follow
rank 0's spec; `runner env` reports the machine. What a run does from a composed spec
is runner/launch/start.py; a sweep's job is runner/sweep/job.py.

Those two, and the worker, are imported where a run starts, not at the top: they
bring torch, transformers and Accelerate (about 4 s), which `runner --help`,
`--cfg job` and a mistyped key have no use for (they answer in about 1 s).
"""

from __future__ import annotations

import os

# Back torch's large CPU tensors (logits over a 50k vocabulary) with huge pages:
# measured 27% faster steps for the tiny GPT-2, from ~200k to ~6k page faults a
# step. Read by torch at its first allocation, so set before torch is imported
# below; inherited by spawned workers.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn, Optional  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from hydra.experimental.callback import Callback  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from runner.components.model import hub_reachable  # noqa: E402
from runner.config.errors import RunFailed, UserError, compose_error, exit_with  # noqa: E402
from runner.config.paths import conf_dir  # noqa: E402
from runner.config.spec import load_spec, to_spec  # noqa: E402
from runner.config.store import register, short_hash  # noqa: E402
from runner.distributed.process_group import broadcast_text, init_process_group, joined_launch  # noqa: E402
from runner.report.env_report import main as env_main  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _offline_defaults()
    joined = joined_launch()
    try:
        if argv[:1] == ["env"]:
            env_main()
        elif argv[:1] == ["eval"]:
            _evaluate_run(argv[1:])
        elif argv[:1] == ["certify"]:
            from runner.certify.command import main as certify_main

            certify_main(argv[1:])
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


def _offline_defaults() -> None:
    # datasets/transformers otherwise probe the network on every load; a machine
    # that cannot reach the hub should not wait on it (validation says what to do).
    if "HF_HUB_OFFLINE" not in os.environ and not hub_reachable(timeout_s=2.0):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def refuse(err: UserError) -> NoReturn:
    """Exit 2 with one clear message; as rank 0 of a joined launch, tell the others first."""
    joined = joined_launch()
    if joined is not None and joined.rank == 0:
        init_process_group()
        broadcast_text(None)
    exit_with(err)


def report_failed_run(err: RunFailed) -> NoReturn:
    """Exit 1 with one line; the failing rank's traceback was already printed above."""
    sys.stderr.write(f"runner: {err}; its error is shown above.\n")
    raise SystemExit(1) from None


class RunFolderWatch(Callback):
    """Notes, before Hydra creates hydra.run.dir (run_job does, before the task), the
    outermost folder of it that is not there yet (conf/config.yaml's hydra.callbacks), so
    a refused run can remove what it made and nothing that was there before."""

    made: Optional[Path] = None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from runner.launch.rundir import first_missing

        RunFolderWatch.made = first_missing(Path(str(config.hydra.run.dir)))


def _hydra_task(cfg: Any) -> None:
    hydra_cfg = HydraConfig.get()
    chosen = any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in hydra_cfg.overrides.hydra)
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)

    def make_spec() -> Any:
        try:
            return to_spec(cfg)
        except OmegaConfBaseException as err:  # e.g. a mandatory value (???) left unset
            raise compose_error(err) from None

    from runner.launch.start import start
    from runner.sweep.job import run_sweep_job

    if hydra_cfg.mode == RunMode.MULTIRUN:
        run_sweep_job(make_spec, job_dir, Path(hydra_cfg.sweep.dir), int(hydra_cfg.job.num), overrides, cfg, chosen)
        return
    from runner.launch.rundir import remove_if_unused

    made, RunFolderWatch.made = RunFolderWatch.made, None
    try:
        spec = make_spec()
        start(spec, job_dir, spec.overwrite, cfg, tuple(overrides), chosen)
    except UserError as err:
        refuse(err)  # exit here: Hydra would print "Error executing job" first
    except RunFailed as err:
        report_failed_run(err)
    finally:  # a refused or dry run wrote nothing: the folders Hydra made for it go
        remove_if_unused(job_dir, made)


def _run_spec_file(argv: list[str]) -> None:
    """`runner --spec RUN_DIR/run_spec.yaml`: re-run a frozen spec, no Hydra."""
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
    from runner.launch.start import start

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dir = args.run_dir or Path("outputs") / spec.name / f"{stamp}_{short_hash(args.spec.read_text())}"
    start(spec, run_dir, args.overwrite or spec.overwrite, run_dir_chosen=args.run_dir is not None)


def _evaluate_run(argv: list[str]) -> None:
    """`runner eval RUN_DIR eval.tasks=[...]`: lm-eval's benchmarks on a finished run's saved
    model, with the run's frozen spec and eval.* changed on the command line, nothing else."""
    from omegaconf import OmegaConf

    from runner.report import benchmarks

    usage = "usage: runner eval RUN_DIR [eval.tasks=[austen_next,...]] [eval.limit=N] [eval.num_fewshot=K] ..."
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return
    run_dir, overrides = Path(argv[0]), argv[1:]
    frozen = run_dir / "run_spec.yaml"
    if not frozen.is_file():
        raise UserError(f"runner eval {run_dir}: no run_spec.yaml there. Give the folder of a finished run.\n{usage}")
    other = [o for o in overrides if not o.startswith("eval.")]
    if other:
        raise UserError(f"runner eval changes only eval.* settings (the model is the run's): {' '.join(other)}")
    try:
        spec = load_spec(frozen)
        merged = OmegaConf.merge(OmegaConf.structured(spec), OmegaConf.from_dotlist(overrides))
        spec = OmegaConf.to_object(merged)
    except Exception as err:  # a mistyped key or value: one line naming it
        raise compose_error(err) from None
    if not spec.eval.tasks:
        raise UserError(f"runner eval {run_dir}: no tasks to run. Name them: eval.tasks=[austen_next]")
    problems = benchmarks.check(spec)
    if problems:
        raise UserError(problems)
    benchmarks.evaluate_and_show(spec, run_dir.resolve())


def _follow() -> None:
    """Rank > 0 of a torchrun / accelerate launch / srun launch: no Hydra, rank 0's spec."""
    from runner.launch.launcher import prepare_environment
    from runner.train import worker

    prepare_environment(1)
    worker.run(None)


def _run_hydra(argv: list[str]) -> None:
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


def exit_status(stop: SystemExit) -> int:
    """The status the interpreter exits with for `stop`: its code, or for
    SystemExit("message") the message on stderr and 1, as Python does."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    sys.stderr.write(f"{stop.code}\n")
    return 1


def entry() -> None:
    """The `runner` command (and `python -m runner`): main(), then out without the
    interpreter's teardown. Unloading torch, transformers and datasets module by module
    costs a process that imported them about 2.6 CPU-s (measured: `import
    transformers.modeling_utils` exits in 9.4 s, 6.8 s through os._exit), after the run
    has printed everything. What the teardown does that matters still happens: atexit
    handlers (logging's flush, multiprocessing's joins), threads a run left, the streams.
    Only the command leaves this way; main() called in a process (tests) returns."""
    import atexit
    import threading

    try:
        main()
        code = 0
    except SystemExit as stop:
        code = exit_status(stop)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
