"""How this node's workers start (launch.start_method): spawned, or forked from a server.

A spawned worker is a fresh interpreter: it imports torch, transformers, accelerate and
datasets again, seconds of CPU each, most of a short run's cost on a small machine (a
2-process MICRO run: 41 CPU-s spawned, 26 forked). Forking this launcher instead is not
safe: GNU OpenMP's thread team does not survive a fork, so a worker forked from a
process that already ran torch ops (a sweep's or certify's in-process run, a test
session) hangs in its first parallel kernel (seen: `gomp_team_barrier_wait_end` in
layer_norm). Python's forkserver is a clean process that only imports the worker's
modules, then forks each worker from itself: no OpenMP team, no CUDA, imports paid once
for all the launches of this process.

A forked worker inherits the server's environment from when it started, not this
launcher's at the launch: `environment_for` hands the launch's own environment to the
worker, which `adopt` puts back under what torch elastic set for its rank.

With CUDA, auto spawns: a library that initialises CUDA while being imported would make
the server's children unable to use it, and a GPU run's import time is small beside it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
from typing import Optional

import torch

from runner.config.spec import LaunchSpec, StartMethod

# What the worker imports: the server imports it once, its forks have it. First, what
# keeps the server alive through a signal sent to the launcher's process group.
SERVER_PRELOAD = ["runner.launch.forkserver_preload"]
WORKER_MODULE = "runner.launch.launcher"
# Then what the worker imports where it uses it (transformers' models, peft, DeepSpeed):
# once in the server, not once in each worker (runner/launch/worker_preload.py).
WORKER_LIBRARIES = "runner.launch.worker_preload"
# The signals the server ignores (forkserver_preload), back to their default in a worker.
SERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)

# The environment the forkserver started with (its children's, before adopt); None: not started.
_server_environment: Optional[dict[str, str]] = None

Environment = tuple[dict[str, str], dict[str, str]]  # (the server's at its start, the launch's)


def resolve(launch: LaunchSpec) -> str:
    """launch.start_method as torch elastic names it: auto is forkserver on a machine
    without CUDA, spawn with it."""
    if launch.start_method != StartMethod.auto:
        return launch.start_method.value
    return "spawn" if torch.cuda.is_available() else "forkserver"


def environment_for(method: str) -> Optional[Environment]:
    """What a worker started by `method` needs to run in this launch's environment: for
    forkserver, the server's environment and this one (the server starts here, once per
    process, importing the worker's modules); for spawn, nothing (it inherits this one)."""
    global _server_environment
    if method != "forkserver":
        return None
    if _server_environment is None:
        multiprocessing.set_forkserver_preload([*SERVER_PRELOAD, WORKER_MODULE, WORKER_LIBRARIES])
        multiprocessing.forkserver.ensure_running()
        _server_environment = dict(os.environ)
    return _server_environment, dict(os.environ)


def adopt(environment: Optional[Environment]) -> None:
    """In a worker: this launch's environment, with what torch elastic set for this rank
    (RANK, WORLD_SIZE, MASTER_PORT, ...: whatever differs from the server's) on top; then
    the thread count it names (torch read the server's when it was imported)."""
    if environment is not None:
        for signum in SERVER_IGNORES:  # the server's choice, not the worker's (forkserver_preload.py)
            signal.signal(signum, signal.SIG_DFL)
        server, launch = environment
        rank_settings = {k: v for k, v in os.environ.items() if server.get(k) != v}
        os.environ.clear()
        os.environ.update(launch)
        os.environ.update(rank_settings)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
