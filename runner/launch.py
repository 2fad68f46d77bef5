"""Run the workers: in this process at world size 1, else spawn them (torch elastic).

`accelerate launch --cpu --num_processes 2` silently starts one process, so we spawn
with torch's elastic launcher ourselves: c10d rendezvous, spawn start method, and
`@record` on the entry so a worker's traceback reaches the user.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from runner.spec import LaunchSpec, RunSpec


def resolve_nproc(launch: LaunchSpec) -> int:
    if launch.nproc_per_node != "auto":
        return int(launch.nproc_per_node)
    import torch

    return max(torch.cuda.device_count(), 1)


def world_size(launch: LaunchSpec) -> int:
    return resolve_nproc(launch) * launch.nnodes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@record
def _worker_entry(spec_path: str) -> None:
    from runner.worker import main

    main(spec_path)


def launch(spec: RunSpec, spec_path: Path) -> None:
    nproc = resolve_nproc(spec.launch)
    if nproc * spec.launch.nnodes == 1:
        from runner.worker import train

        train(spec)
        return

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers share the cores: without this each one starts a thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    endpoint = spec.launch.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=spec.launch.nnodes,
        max_nodes=spec.launch.nnodes,
        nproc_per_node=nproc,
        run_id=os.environ.get("RUNNER_RUN_ID", uuid.uuid5(uuid.NAMESPACE_URL, endpoint).hex[:12]),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": spec.launch.node_rank} if spec.launch.nnodes > 1 else {},
        max_restarts=spec.launch.max_restarts,
        start_method="spawn",
        monitor_interval=0.5,
    )
    elastic_launch(config, _worker_entry)(str(spec_path))
