"""Run the workers: in this process at world size 1, else spawn them (torch elastic).

`accelerate launch --cpu --num_processes 2` silently starts one process, so we spawn
with torch's elastic launcher ourselves: c10d rendezvous, spawn start method, and
`@record` on the entry so a worker's traceback reaches the user. Under torchrun,
`accelerate launch` or srun the processes already exist: we join (runner/distributed.py).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Optional

from torch.distributed.elastic.multiprocessing.errors import record

from runner.errors import UserError
from runner.paths import default_cache_dir
from runner.spec import LaunchSpec, RunSpec


def resolve_nproc(launch: LaunchSpec) -> int:
    if launch.nproc_per_node != "auto":
        return int(launch.nproc_per_node)
    import torch

    return max(torch.cuda.device_count(), 1)


def world_size(launch: LaunchSpec) -> int:
    from runner.distributed import joined_launch

    joined = joined_launch()
    return joined.world_size if joined else resolve_nproc(launch) * launch.nnodes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_environment(local_workers: int, debug: bool = False) -> None:
    """Settings every worker inherits."""
    import torch

    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        os.environ["TORCH_CPP_LOG_LEVEL"] = "INFO"
        if torch.cuda.is_available():
            os.environ["NCCL_DEBUG"] = "INFO"

    # Workers share the cores: without this each one starts a thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // local_workers, 1)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no probing, no warning
    # DeepSpeed JIT-compiles its CPU ops once (~20 s); keep them in our cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir() / "torch_extensions"))


def _run_in_process(spec: RunSpec) -> None:
    from runner.accel import is_zero, reset_accelerate_state
    from runner.worker import run

    saved = dict(os.environ)
    if is_zero(spec.strategy):
        # DeepSpeed always wants a process group, even of one.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    try:
        run(spec)
    finally:
        # A sweep runs its jobs in this process: leave no state for the next one.
        reset_accelerate_state()
        os.environ.clear()
        os.environ.update(saved)


def rendezvous_configs(launch: LaunchSpec) -> dict[str, object]:
    """The c10d rendezvous settings of a multi-node launch.

    torch's defaults (join 600 s, store reads 60 s) are not the user's to see, and a node
    tokenizes before it joins: both timeouts follow launch.rdzv_timeout instead. The
    read timeout also bounds how long a node waits for the endpoint to answer at all.
    """
    return {
        "is_host": launch.node_rank == 0,  # node 0 hosts the rendezvous store; the others connect
        "join_timeout": launch.rdzv_timeout,
        "read_timeout": launch.rdzv_timeout,
    }


def check_endpoint(launch: LaunchSpec, endpoint: str) -> None:
    """Fail fast, in one line, where torch would retry for minutes and print C++ stack traces.

    Node 0 must be able to listen at the endpoint (it hosts the store there); every other
    node waits, at most launch.rdzv_timeout seconds, for the endpoint to accept connections.
    """
    import time

    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise UserError(
            f"launch.rdzv_endpoint={endpoint}: the host {host!r} does not resolve on this machine ({err.strerror}). "
            "Give node 0's IP address, or a name every node resolves."
        ) from None
    if launch.node_rank == 0:
        with socket.socket(address[0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address[4])
            except OSError as err:
                raise UserError(
                    f"launch.rdzv_endpoint={endpoint}: node 0 hosts the rendezvous there but cannot listen on it "
                    f"({err.strerror}). Give an address of node 0 itself and a free port."
                ) from None
        return
    deadline = time.monotonic() + launch.rdzv_timeout
    for _ in range(launch.rdzv_timeout + 1):  # about one try a second
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                return
        except OSError:
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
    raise UserError(rendezvous_failure(launch, endpoint, None))


def rendezvous_failure(launch: LaunchSpec, endpoint: str, err: Optional[Exception]) -> str:
    """One line for a rendezvous that failed (err None: the endpoint never answered)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    if err is None or isinstance(err, RendezvousConnectionError):
        what = f"nothing answered at launch.rdzv_endpoint={endpoint}"
    elif isinstance(err, RendezvousTimeoutError):
        what = f"not all {launch.nnodes} nodes joined the rendezvous at launch.rdzv_endpoint={endpoint}"
    else:
        what = f"the rendezvous at launch.rdzv_endpoint={endpoint} failed ({type(err).__name__})"
    return (
        f"{what} within launch.rdzv_timeout={launch.rdzv_timeout} s. Start every node with the same "
        "launch.rdzv_endpoint (node 0's address, reachable from every node) and launch.nnodes, "
        "or raise launch.rdzv_timeout if a node starts later than that."
    )


@record
def _worker_entry(spec_path: str) -> None:
    from runner.worker import main

    main(spec_path)


def launch(spec: RunSpec, spec_path: Path) -> None:
    from runner.distributed import joined_launch
    from runner.worker import run

    if joined_launch() is not None:  # we are rank 0 of an outside launch
        prepare_environment(1, spec.launch.debug)
        run(spec)
        return
    nproc = resolve_nproc(spec.launch)
    prepare_environment(nproc, spec.launch.debug)
    if nproc * spec.launch.nnodes == 1:
        _run_in_process(spec)
        return

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
        start_method="spawn",
        monitor_interval=0.5,
    )
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if multi_node:
        check_endpoint(spec.launch, endpoint)
    try:
        elastic_launch(config, _worker_entry)(str(spec_path))
    except RendezvousError as err:
        raise UserError(rendezvous_failure(spec.launch, endpoint, err)) from None
