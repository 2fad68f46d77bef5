"""launch.engine=ray: the workers run under Ray Train's TorchTrainer (its v2 API).

The launcher has composed, validated and frozen the spec (run_spec.yaml) as for any
launch; only it ran Hydra. Here it connects to a Ray cluster (launch.ray_address), checks
that the cluster holds the workers, and hands Ray Train one function, `train_loop`, which
every worker runs: runner's own worker entry on the frozen spec's path
(runner/launch/worker_entry.py `run_worker`), as a torch elastic worker does.

Ray Train starts torch.distributed itself before that function runs (gloo on a CPU, NCCL
with GPUs, the same backends runner picks) and sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT as torchrun does. runner's worker then finds the group
initialised and uses it (runner/distributed/process_group.py `init_process_group`
returns early), so from there on a Ray worker runs the very code a torch elastic one
runs: one path, and the same steps bit for bit.

Checkpoints: after each one runner saves, every rank reports it to Ray
(`ray.train.report`, at the same steps: a collective), in place. Ray's experiment folder
(RunConfig storage_path / name) is the run folder itself, so the checkpoints under
`checkpoints/` are already where Ray keeps them and nothing is copied. `launch.max_restarts`
is Ray's FailureConfig(max_failures): a restarted worker group is told its attempt's
number (`RUNNER_RESTART_COUNT`, runner/train/ledger.py) and resumes from the newest
complete checkpoint, as a torch elastic restart does; the goodput ledger books the time
lost.

Elastic (launch.min_workers): Ray Train gets the range num_workers=(min_workers, all of
them), sizes each group by what the cluster holds, and restarts it smaller after a loss or
larger when resources return. Each group's ranks plan for its size and derive their
accumulation from the global batch the launcher froze into the spec
(runner/train/worker.py `run`), so every group resumes the newest checkpoint as a resume
on another world size does; runner/launch/elastic.py refuses a range that could not.

Failures: a rank that raises notes why where the launcher reads it
(runner/launch/failure_notes.py); the launcher prints that rank's traceback once and
exits non-zero, as for a torch elastic launch. Ray's own copies of it (the worker's log
line, the controller's failure report) are kept out of the console.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from runner.config.errors import RunFailed, UserError
from runner.config.spec import LaunchSpec, RunSpec
from runner.config.validate import host_port
from runner.distributed.world import PLANNED_WORLD_SIZE_ENV, world_size
from runner.launch import failure_notes
from runner.launch.environ import restored
from runner.launch.worker_entry import run_worker
from runner.train.checkpoint import add_checkpoint_hook
from runner.train.ledger import ATTEMPT_ENV, ENGINE_STARTUP_ENV

if TYPE_CHECKING:
    from ray.train import Result

INSTALL = 'pip install "runner[ray]"'

# What a worker takes from the launcher's environment (Ray starts worker processes from
# its own daemons, which on a running cluster never saw it): runner's settings (the
# planned world size, the failure-notes folder, the data cache), the libraries' switches
# (offline hub, DeepSpeed's accelerator and JIT cache, threads, distributed debug logs),
# and the Python path. Never the device masks or Ray's own: Ray sets those per worker.
FORWARDED_PREFIXES = ("RUNNER_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_", "NCCL_", "DS_", "OMP_", "MKL_",
                      "THP_", "PYTHON")

# Ray Train's switches, read in this process where a run is set up. v2 is the default of
# the releases runner supports, said anyway. The workers stay in the launcher's working
# directory (a spec may name files relative to it) instead of Ray's per-run folder. No
# metrics exporter (there is no dashboard to read it) and no print patch (a worker's
# lines would reach the console twice).
RAY_TRAIN_SETTINGS = {
    "RAY_TRAIN_V2_ENABLED": "1",
    "RAY_CHDIR_TO_TRIAL_DIR": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}
# A local Ray started for one run: no usage report, no preemption watcher (a machine of
# one's own is not preempted; its start logs an error line), and each worker's lines as
# they are (deduplication would fold identical lines of different ranks into one).
LOCAL_RAY_SETTINGS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_DEDUP_LOGS": "0",
}


PROBE_SECONDS = 10.0  # how long a cluster's head may take to accept a connection


def forwarded_environment(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The launcher's settings a Ray worker needs (see FORWARDED_PREFIXES)."""
    environ = dict(os.environ) if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}


def workers(launch: LaunchSpec) -> int:
    """Ray places launch.nnodes x launch.nproc_per_node workers on the cluster's nodes."""
    return world_size(launch)


def connect(launch: LaunchSpec) -> Callable[[], None]:
    """Connect this process to the Ray cluster launch.ray_address names, starting a local
    one for auto without RAY_ADDRESS; returns what ends the connection (a no-op when this
    process was connected already: its owner ends it)."""
    try:
        import ray
    except ImportError:
        raise UserError(f"launch.engine=ray needs Ray Train, which is not installed: {INSTALL} "
                        "(or launch.engine=local).") from None
    if ray.is_initialized():
        return lambda: None
    address = launch.ray_address
    named_by = "launch.ray_address"
    if address == "auto":
        address, named_by = os.environ.get("RAY_ADDRESS", ""), "RAY_ADDRESS"
    # Ray's own logs stay in its session folder; on the console only errors.
    quiet = {"log_to_driver": True, "logging_level": logging.ERROR,
             "logging_config": ray.LoggingConfig(encoding="TEXT", log_level="ERROR")}
    if not address:
        os.environ.update(LOCAL_RAY_SETTINGS)
        ray.init(address="local", include_dashboard=False, **quiet)
        return ray.shutdown
    unreachable = f"{named_by}={address}: no Ray cluster answers there ({{}}). Start one with `ray start --head` " + (
        "and name the address it prints, or use launch.ray_address=auto without RAY_ADDRESS for a local Ray.")
    problem = probe(address)
    if problem:
        raise UserError(unreachable.format(problem))
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as err:
        # Something listens (probed above), but no Ray this process may join: most often a
        # cluster with token authentication (Ray's default for a `ray start` where a token
        # exists), which Ray applies to an explicit address only when asked to.
        raise UserError(
            f"{named_by}={address}: could not join the Ray cluster there ({_first_line(err)}). If it uses token "
            "authentication, set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN, unless the token is in ~/.ray/auth_token); "
            "else check that the address is the head's, as `ray start --head` prints it.") from None
    return ray.shutdown


def probe(address: str, timeout_s: float = PROBE_SECONDS) -> str:
    """Why nothing listens at a HOST:PORT (or ray://HOST:PORT) address, '' when something
    does. ray.init retries an address nobody listens at without end (seen: over 5 minutes,
    a warning every 30 s), so the launcher asks once, bounded, first."""
    parsed = host_port(address.removeprefix("ray://"))
    if parsed is None:
        return ""  # not HOST:PORT (RAY_ADDRESS=auto, ...): Ray resolves it
    host, port = parsed
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as err:
        return f"{host}:{port}: {err.strerror or type(err).__name__}"


def num_workers(launch: LaunchSpec) -> int | tuple[int, int]:
    """Ray Train's num_workers: all of them, or with launch.min_workers the elastic range."""
    most = workers(launch)
    fewest = launch.min_workers
    return most if fewest is None or fewest == most else (fewest, most)


def check_resources(launch: LaunchSpec, resources: dict[str, float], address: str) -> bool:
    """Whether the workers get a GPU each (the cluster has GPUs); refuses, in one line, more
    workers than the cluster has GPUs (or CPUs, one a worker, without GPUs): all of them, or
    under launch.min_workers the fewest (Ray starts with what there is, and grows the group)."""
    wanted, gpus, cpus = workers(launch), int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    kind, have = ("GPUs", gpus) if gpus else ("CPUs", cpus)
    if launch.min_workers is not None and launch.min_workers > have:
        raise UserError(
            f"launch.min_workers={launch.min_workers} Ray workers at least, but the Ray cluster ({address}) has "
            f"{have} {kind} (one a worker): lower launch.min_workers to fit, or add nodes to the cluster.")
    if launch.min_workers is None and wanted > have:
        raise UserError(
            f"launch.nnodes x launch.nproc_per_node = {wanted} Ray workers, but the Ray cluster ({address}) has "
            f"{have} {kind} (one a worker): lower launch.nproc_per_node or launch.nnodes to fit, set "
            "launch.min_workers to go on with fewer, or add nodes to the cluster.")
    return gpus > 0


def launch(spec: RunSpec, spec_path: Path, launched: Optional[float]) -> None:
    """Run the frozen spec's workers under Ray Train; returns when the run finished,
    raises RunFailed (or UserError) otherwise."""
    # Ray's switches hold for this launch only: a sweep's next job, in this process, starts clean.
    with restored({**RAY_TRAIN_SETTINGS, **LOCAL_RAY_SETTINGS}):
        for key, value in RAY_TRAIN_SETTINGS.items():
            os.environ.setdefault(key, value)
        connecting = time.time()  # the goodput ledger's ray_startup part starts here
        disconnect = connect(spec.launch)
        try:
            import ray

            use_gpu = check_resources(spec.launch, ray.cluster_resources(), spec.launch.ray_address)
            with failure_notes.collecting() as notes:  # named in the workers' environment
                try:
                    fit(spec, spec_path, launched, use_gpu, connecting)
                except _training_failed() as err:
                    raise _run_failed(err, failure_notes.read(notes)) from None
        finally:
            disconnect()


def fit(spec: RunSpec, spec_path: Path, launched: Optional[float], use_gpu: bool, connecting: float) -> "Result":
    """Ray Train's TorchTrainer on the run's workers."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = Path(spec.run_dir).resolve()
    # On the launcher's node, as Ray Train's controller is: a node lost with the workers on it
    # must not take the count with it.
    here = {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}
    attempts = ray.remote(num_cpus=0, label_selector=here)(AttemptCounter).remote()
    count = num_workers(spec.launch)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"spec_path": str(spec_path), "launched": launched, "attempts": attempts,
                           "cwd": os.getcwd(), "connecting": connecting, "elastic": isinstance(count, tuple)},
        scaling_config=ScalingConfig(num_workers=count, use_gpu=use_gpu),
        torch_config=TorchConfig(timeout_s=int(spec.launch.timeout_minutes * 60)),
        run_config=RunConfig(
            # Ray's experiment folder is the run folder: the checkpoints reported are already in it.
            name=run_dir.name, storage_path=str(run_dir.parent),
            failure_config=FailureConfig(max_failures=spec.launch.max_restarts),
            # runner prunes its checkpoints itself (train.keep_checkpoints); Ray only keeps account.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            worker_runtime_env={"env_vars": forwarded_environment()},
            # Not its progress and failure reports (INFO), nor its warnings of a loaded machine: errors only.
            logging_config=LoggingConfig(log_level="ERROR"),
        ),
    )
    return trainer.fit()


class AttemptCounter:
    """A Ray actor of the launch: the number of worker groups started so far. Rank 0 of each
    group takes the next and tells the others (Ray Train hands a restarted group the same
    train_loop_config, so the count cannot travel in it)."""

    def __init__(self) -> None:
        self.started = 0

    def next(self) -> int:
        self.started += 1
        return self.started - 1


def train_loop(config: dict[str, Any]) -> None:
    """Each Ray Train worker: its attempt's number, then runner's worker on the frozen spec,
    reporting each checkpoint to Ray. Ray runs it in a thread of the worker's process."""
    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    rank = ray.train.get_context().get_world_rank()
    attempt = broadcast_from_rank_zero(ray.get(config["attempts"].next.remote()) if rank == 0 else None)
    os.environ[ATTEMPT_ENV] = str(attempt)
    if attempt == 0:  # Ray's start-up, its own part of the ledger (a restart's time is booked as lost)
        os.environ[ENGINE_STARTUP_ENV] = f"{max(time.time() - config['connecting'], 0.0):.3f}"
    # Ray logs a failing function's traceback here, and its controller again: the launcher
    # prints the failing rank's once (launch's _run_failed).
    logging.getLogger("ray.train.v2._internal.util").setLevel(logging.CRITICAL)
    # Each report is logged at INFO by a logger named after its file, outside the "ray"
    # loggers: it would reach runner's console and run.log (runner/report/log.py).
    reporting = sys.modules.get("ray.train.v2._internal.execution.context")
    if reporting is not None and reporting.__file__:
        logging.getLogger(reporting.__file__).setLevel(logging.WARNING)
    # Ray names each worker's device for Accelerate; on a CPU that is "cpu:0", which the
    # default launch never sets (Accelerate then says "cpu": the banner differed). On GPUs
    # it is the device Ray bound the worker to (torch.cuda.set_device), kept.
    if os.environ.get("ACCELERATE_TORCH_DEVICE", "").startswith("cpu"):
        del os.environ["ACCELERATE_TORCH_DEVICE"]
    world = ray.train.get_context().get_world_size()
    # An elastic group (launch.min_workers) is as large as the cluster allowed: the world size
    # its ranks plan for and derive their accumulation at (runner/train/worker.py `run`).
    # Ray keeps it in the range; a fixed group is the launcher's plan, checked as planned.
    if config["elastic"]:
        os.environ[PLANNED_WORLD_SIZE_ENV] = str(world)
    if world == 1:
        as_one_process(config["spec_path"])
    if os.path.isdir(config["cwd"]):  # the launcher's, where relative paths of the spec point
        os.chdir(config["cwd"])
    remove = add_checkpoint_hook(report_checkpoint)
    try:
        run_worker([config["spec_path"]], config["launched"])
    finally:
        remove()


def as_one_process(spec_path: str) -> None:
    """One worker runs as the default launch runs one, in the launcher's own process
    (runner/launch/launcher.py `_run_in_process`): Ray Train made a process group of one and
    set LOCAL_RANK, with which Accelerate counts the run as distributed (device cpu:0, not
    cpu). The group goes; the torchrun variables stay only for a strategy that needs a group
    of one (DeepSpeed), as there. RANK stays: this rank's failure note is filed under it."""
    import torch.distributed as dist

    from runner.config.spec import load_spec
    from runner.distributed.strategies import build_strategy

    if dist.is_initialized():
        dist.destroy_process_group()
    spec = load_spec(Path(spec_path))
    if not build_strategy(spec.strategy, spec.precision).needs_process_group():
        for key in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        return
    # A fresh port, as there: Ray's group held the one Ray chose.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]), WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def report_checkpoint(path: Path, figures: dict[str, Any]) -> None:
    """Tell Ray Train of a checkpoint runner completed, in place (it is in Ray's experiment
    folder, the run folder): every rank, at the same steps."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    ray.train.report(dict(figures), checkpoint=Checkpoint.from_directory(str(path)),
                     checkpoint_dir_name=path.name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def _training_failed() -> type[BaseException]:
    from ray.train import TrainingFailedError

    return TrainingFailedError


def _run_failed(err: BaseException, notes: list[failure_notes.FailureNote]) -> RunFailed:
    """How the run failed, as one line, after the failing rank's traceback (printed once):
    the rank that failed first by its own account, else Ray's record of the failures."""
    noted = failure_notes.first(notes)
    if noted is not None:
        if noted.callstack:
            sys.stderr.write(f"[rank {noted.rank}] {noted.callstack.rstrip()}\n")
        return RunFailed(f"worker rank {noted.rank} failed under Ray Train: {noted.reason}")
    failures = getattr(err, "worker_failures", None)
    if failures:  # a rank that could not write its note (another machine's /tmp, killed)
        rank = min(failures)
        reason = _first_line(failures[rank]) or type(failures[rank]).__name__
        return RunFailed(f"worker rank {rank} failed under Ray Train: {reason}")
    cause = getattr(err, "controller_failure", err)
    return RunFailed(f"Ray Train failed: {type(cause).__name__}: {_first_line(cause)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
