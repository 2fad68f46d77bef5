"""Process-group plumbing: joining an outside launch, and making all ranks agree on the spec.

Three ways workers start:
- spawned by our launcher (runner/launch/launcher.py, torch elastic), one launcher per node;
- joined: started by torchrun / `accelerate launch` / srun with one task per GPU. Each
  process runs the `runner` command; only rank 0 composes with Hydra, the others
  receive its frozen spec;
- in-process at world size 1.
In every multi-process case rank 0's spec is the one all ranks run; a rank whose
own spec differs in anything but its run folder and node rank stops the run.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from runner.config.spec import RunSpec, flat_spec_dict, spec_from_yaml, spec_to_yaml


@dataclass(frozen=True)
class JoinedLaunch:
    rank: int
    world_size: int
    local_rank: int
    source: str


def _first_slurm_host() -> str:
    import subprocess

    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0].split("[")[0] or "127.0.0.1"


def joined_launch() -> Optional[JoinedLaunch]:
    """An outside launcher already started every process: describe this one, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env and int(env["WORLD_SIZE"]) > 1:
        source = "torchrun/accelerate launch" if "TORCHELASTIC_RUN_ID" in env else "environment"
        return JoinedLaunch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), source)
    tasks = int(env.get("SLURM_NTASKS", "1"))
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    if "SLURM_PROCID" in env and tasks > 1 and tasks != nodes:
        # srun with one task per GPU: translate Slurm's variables for torch.distributed.
        env.setdefault("MASTER_ADDR", _first_slurm_host())
        env.setdefault("MASTER_PORT", "29500")
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], str(tasks)
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        return JoinedLaunch(int(env["RANK"]), tasks, int(env["LOCAL_RANK"]), "srun")
    return None


def slurm_node_launch() -> Optional[tuple[int, int, str]]:
    """srun with one task per node: (nnodes, node_rank, rendezvous endpoint), else None."""
    env = os.environ
    tasks = int(env.get("SLURM_NTASKS", "0"))
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "0")))
    if "SLURM_PROCID" in env and tasks == nodes and nodes > 1:
        return nodes, int(env["SLURM_NODEID"]), f"{_first_slurm_host()}:{env.get('MASTER_PORT', '29500')}"
    return None


def device_index(local_rank: int, visible: int) -> int:
    """The CUDA device this process trains on, out of the `visible` ones.

    One device per local rank (torchrun, our launcher, srun with all GPUs visible to each
    task): device `local_rank`. srun with --gpus-per-task=1 or GPU binding shows each task
    only its own GPU, so the index is 0 whatever the local rank."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"local rank {local_rank} has no GPU of its own: this process sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Start at most one process per "
        "visible GPU (launch.nproc_per_node, srun --ntasks-per-node), or give each task one GPU (--gpus-per-task=1)."
    )


def select_device() -> int:
    """Bind this process to its GPU (see device_index) and return the index."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = device_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    if index != local_rank:
        # DeepSpeed's engine calls set_device(int(LOCAL_RANK)) itself: with one GPU per
        # task that ordinal must be the task's only device. Accelerate's local process
        # index follows, so every task is its node's "local main" (each then reads the
        # data cache under its lock; see runner/components/data/prepare.py).
        os.environ["LOCAL_RANK"] = str(index)
    return index


_GROUPS_STARTED = itertools.count()


def init_process_group(timeout_minutes: float = 30.0) -> None:
    """Initialise torch.distributed from the environment (Accelerate reuses it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        select_device()
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Workers restarted by launch.max_restarts meet in the same agent store as the
        # attempt before them; without a fresh key prefix gloo can read a dead
        # process's address and wait forever (seen here). One prefix per attempt.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
        # One more per group this process starts (runner certify runs several in turn).
        store = dist.PrefixStore(f"runner/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
                                 f"group_{next(_GROUPS_STARTED)}", base)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def broadcast_text(text: Optional[str]) -> Optional[str]:
    """Rank 0's text on every rank (None means: rank 0 gave up)."""
    import torch.distributed as dist

    payload = [text]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


_LOCAL_FIELDS = ("run_dir", "launch.node_rank")


def spec_differences(mine: RunSpec, leader: RunSpec) -> list[str]:
    a, b = flat_spec_dict(mine), flat_spec_dict(leader)
    return [f"{k}: {a.get(k)!r} here, {b.get(k)!r} on rank 0" for k in sorted(a) if k not in _LOCAL_FIELDS and a.get(k) != b.get(k)]


def agree_on_spec(mine: Optional[RunSpec]) -> RunSpec:
    """Every rank gets rank 0's spec; a different local spec is an error."""
    import torch.distributed as dist

    rank = dist.get_rank()
    text = broadcast_text(spec_to_yaml(mine) if rank == 0 and mine is not None else None)
    if text is None:
        raise SystemExit(2)  # rank 0 refused the spec and said why
    leader = spec_from_yaml(text)
    if mine is not None and rank != 0:
        diffs = spec_differences(mine, leader)
        if diffs:
            raise RuntimeError(
                f"rank {rank} was started with a different spec than rank 0 ({'; '.join(diffs)}). "
                "Start every node with the same recipe and overrides."
            )
    return leader


_flag_group: dict[int, object] = {}  # per process group (a test may make several): its gloo group for host flags


def all_ranks_agree(flag: bool) -> bool:
    """True when `flag` is true on every rank (a collective: all ranks call it).

    On a host tensor over gloo: under NCCL a device tensor would make the host wait for
    the GPU at each call, so a gloo group is made for it once (on every rank at the same
    call, as new_group requires)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    world = id(dist.group.WORLD)
    if world not in _flag_group:
        _flag_group.clear()
        _flag_group[world] = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_flag_group[world])
    return bool(value.item())
