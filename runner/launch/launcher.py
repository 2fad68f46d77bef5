"""Run the workers: in this process at world size 1, else spawn them (torch elastic).

`accelerate launch --cpu --num_processes 2` silently starts one process, so we start
the workers with torch's elastic launcher ourselves: c10d rendezvous, workers forked
from a forkserver on a CPU machine or spawned with CUDA (launch.start_method), and
`@record` on the entry so a worker's traceback reaches the user. Under torchrun,
`accelerate launch` or srun the processes already exist: we join (runner/distributed/process_group.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from runner.config.errors import UserError
from runner.config.paths import default_cache_dir
from runner.config.spec import LaunchEngine, RunSpec
from runner.distributed.accelerator import reset_accelerate_state
from runner.distributed.process_group import joined_launch
from runner.distributed.strategies import build_strategy
from runner.distributed.world import PLANNED_WORLD_SIZE_ENV, resolve_nproc, world_size
from runner.launch import failure_notes
from runner.launch.cpus import usable_cpus
from runner.launch.environ import restored
from runner.launch.rendezvous import check_endpoint, rendezvous_configs, rendezvous_failure
from runner.launch.start_method import Environment, adopt, environment_for, resolve
from runner.launch.worker_entry import run_worker
from runner.train import worker


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_environment(local_workers: int, debug: bool = False) -> None:
    """Settings every worker inherits."""
    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        os.environ["TORCH_CPP_LOG_LEVEL"] = "INFO"
        if torch.cuda.is_available():
            os.environ["NCCL_DEBUG"] = "INFO"

    # Workers share the cores this process may use (affinity, cgroup quota; see
    # runner/launch/cpus.py): without this each one starts a thread per core of the machine.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(usable_cpus() // local_workers, 1)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no probing, no warning
    # DeepSpeed JIT-compiles its CPU ops once (~20 s); keep them in our cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir() / "torch_extensions"))
    clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


# Longer than any build of a JIT op takes (DeepSpeed's CPU Adam: ~20 s alone, 2 min on a
# loaded 2-core machine), so a lock this old belongs to no build still running.
STALE_LOCK_SECONDS = 600.0


def clear_stale_build_locks(root: Path, older_than: float = STALE_LOCK_SECONDS) -> list[Path]:
    """Remove the build locks a killed build left under `root`; returns them.

    torch builds a JIT extension (DeepSpeed's CPU Adam for strategy.offload_optimizer=cpu)
    holding `<root>/<op>/lock`, and a later build waits while the file exists
    (torch.utils.file_baton: no owner, no timeout). A build killed mid-way (Ctrl-C, a
    timeout) leaves it, and every later run then hangs in the optimizer's constructor
    without a word (seen: a CI run waited out a test's 15 minutes on one from hours before)."""
    now, removed = time.time(), []
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else []:
        try:
            age = now - lock.stat().st_mtime
            if age > older_than:
                lock.unlink()
        except FileNotFoundError:  # its build just finished
            continue
        if age > older_than:
            removed.append(lock)
            logging.getLogger("runner").warning(
                "runner: removed %s, left %.0f minutes ago by a JIT build that was killed (a later build would "
                "wait on it forever)", lock, age / 60)
    return removed


def _run_in_process(spec: RunSpec, launched: Optional[float]) -> None:
    saved = dict(os.environ)
    if build_strategy(spec.strategy, spec.precision).needs_process_group():
        # DeepSpeed always wants a process group, even of one.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    try:
        worker.run(spec, launched)
    finally:
        # A sweep runs its jobs in this process: leave no state for the next one, also
        # after a job that failed before it could close its (one-process) group.
        reset_accelerate_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@record
def _worker_entry(environment: Optional[Environment], launched: Optional[float], *spec_paths: str) -> None:
    """A started worker: each run of `spec_paths` in turn. `environment`: the launch's, for a
    worker forked from the forkserver (runner/launch/start_method.py). `launched`: the
    launch's start for the goodput ledger (runner/train/ledger.py), handed to a restarted
    worker unchanged (torch elastic keeps the entry's arguments); None: each run starts its own."""
    adopt(environment)
    run_worker(spec_paths, launched)


def launch(spec: RunSpec, spec_path: Path, launched: Optional[float] = None) -> None:
    """Run the workers of one frozen run. `launched`: when the launch began (runner/launch/start.py),
    where the goodput ledger's wall time starts; None: when the worker takes the run."""
    with planned_world(spec):
        _launch(spec, spec_path, launched)


def launch_in_turn(spec: RunSpec, spec_paths: list[Path]) -> None:
    """Several frozen runs on one set of spawned workers, one after another: each worker
    imports torch, transformers and DeepSpeed once, not once a run (runner certify runs
    dozens of seconds-long runs). `spec` stands for them all: they share its launch
    settings (one node, launch.nproc_per_node workers, no restarts)."""
    assert spec.launch.nnodes == 1 and spec.launch.max_restarts == 0, "one node, no restarts"
    with planned_world(spec):
        nproc = resolve_nproc(spec.launch)
        prepare_environment(nproc, spec.launch.debug)
        _spawn(spec, nproc, [str(p) for p in spec_paths], None)  # each run's ledger starts with the run itself


@contextmanager
def planned_world(spec: RunSpec) -> Iterator[None]:
    # The plan is inherited by spawned workers, and only by them: left in this process's
    # environment, a later launch from it (a test session, a torchrun started by a sweep
    # job) would hand a stale plan to ranks that never saw this launcher.
    with restored([PLANNED_WORLD_SIZE_ENV]):
        os.environ[PLANNED_WORLD_SIZE_ENV] = str(world_size(spec.launch))
        yield


def start_server_early(spec: RunSpec) -> None:
    """When this launch will fork its workers from the forkserver, start the server now:
    it imports the workers' libraries (about 10 CPU-s, runner/launch/worker_preload.py)
    while this process validates, tokenizes and plans, instead of after it, when the
    launch would wait for it (a 2-process tiny run: 34 s, the first step at 27 s). A
    launch refused meanwhile leaves the server to end with this process."""
    from runner.config.validate import check_launch

    if (joined_launch() is None and not check_launch(spec) and spec.launch.engine is LaunchEngine.local
            and not _in_this_process(spec, resolve_nproc(spec.launch))):
        environment_for(resolve(spec.launch))


def _in_this_process(spec: RunSpec, nproc: int) -> bool:
    """One worker that will never be restarted runs in the launcher's process: a worker
    there could not be restarted after a crash, so a restartable one is spawned."""
    return nproc * spec.launch.nnodes == 1 and spec.launch.max_restarts == 0


def _launch(spec: RunSpec, spec_path: Path, launched: Optional[float]) -> None:
    if joined_launch() is not None:  # we are rank 0 of an outside launch
        prepare_environment(1, spec.launch.debug)
        worker.run(spec, launched)
        return
    nproc = resolve_nproc(spec.launch)
    prepare_environment(nproc, spec.launch.debug)
    if spec.launch.engine is LaunchEngine.ray:
        from runner.launch import ray_engine  # Ray is an extra (runner[ray]): imported only for its launches

        ray_engine.launch(spec, spec_path, launched)
        return
    if _in_this_process(spec, nproc):
        _run_in_process(spec, launched)
        return
    _spawn(spec, nproc, [str(spec_path)], launched)


def _spawn(spec: RunSpec, nproc: int, spec_paths: list[str], launched: Optional[float]) -> None:
    multi_node = spec.launch.nnodes > 1
    endpoint = spec.launch.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=spec.launch.nnodes,
        max_nodes=spec.launch.nnodes,
        nproc_per_node=nproc,
        # Every node must name the same run id: derive it from the shared endpoint.
        run_id=uuid.uuid5(uuid.NAMESPACE_URL, f"runner:{endpoint}").hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rendezvous_configs(spec.launch) if multi_node else {},
        max_restarts=spec.launch.max_restarts,
        start_method=(method := resolve(spec.launch)),
        monitor_interval=0.5,
    )
    # The launcher's own log of a worker's exit is a traceback of torch's process
    # bookkeeping, not of the failure: the worker's traceback (@record) or its one-line
    # UserError is already printed, and start() names the rank and its exit code.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    if multi_node:
        check_endpoint(spec.launch, endpoint)
    with failure_notes.collecting() as notes:  # before environment_for: a forked worker takes this environment
        try:
            elastic_launch(config, _worker_entry)(environment_for(method), launched, *spec_paths)
        except ChildFailedError as err:
            err.failure_notes = failure_notes.read(notes)  # type: ignore[attr-defined]  # read by start.launch_failures
            raise
        except RendezvousError as err:
            raise UserError(rendezvous_failure(spec.launch, endpoint, err)) from None
