"""launch.min_workers: a Ray launch that goes on with fewer workers (Ray Train's elastic
num_workers=(min, max)), checked before any worker starts.

Ray starts as many workers as the cluster holds, from launch.min_workers up to
launch.nnodes x launch.nproc_per_node; after a loss it restarts the group on what is left,
and it grows the group again when resources return. Each group resumes from the newest
checkpoint, as any resume on another world size does (runner/train/resume.py), so the
run stays the one that was planned only if every size in the range keeps the global batch
(the accumulation is derived at each: runner/config/batch.py `accumulation_at`) and the
strategy reads a checkpoint written at another size. Those are refused here, in one line
each, at launch, instead of on the cluster the night a node is lost.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from runner.config.batch import global_batch
from runner.config.rl_checks import check_rl
from runner.config.spec import LaunchEngine, RunSpec
from runner.config.validate import check_fsdp_world_size
from runner.train.reshard import needs_reshard, unsupported


def elastic_problems(spec: RunSpec, world: Optional[int]) -> list[str]:
    """Why launch.min_workers cannot be honoured for this run at `world` workers at most
    (empty when it can, or is not set). world None: launch.* is invalid (reported elsewhere)."""
    fewest, launch = spec.launch.min_workers, spec.launch
    if fewest is None or world is None:
        return []
    if launch.engine is not LaunchEngine.ray:
        return [f"launch.min_workers={fewest} is Ray Train's elastic range: add launch.engine=ray, or remove "
                "launch.min_workers (launch.engine=local always runs launch.nnodes x launch.nproc_per_node workers)."]
    if not 1 <= fewest <= world:
        return [f"launch.min_workers={fewest} must be 1..{world} (launch.nnodes x launch.nproc_per_node, the most "
                "workers the run has)."]
    if fewest == world:
        return []  # the range of one size: Ray's fixed group
    problems = []
    if launch.max_restarts < 1:
        problems.append(f"launch.min_workers={fewest}: Ray goes on with fewer workers by restarting the group from the "
                        "newest checkpoint, and each loss is a restart: set launch.max_restarts=1 or more.")
    if spec.data.streaming:
        problems.append(f"launch.min_workers={fewest}: a stream resumes only in its own layout (world size, per-device "
                        "batch, accumulation), so a smaller group could not continue it. Use data.streaming=false, "
                        "or remove launch.min_workers.")
    micro = spec.train.per_device_batch_size
    total = spec.train.global_batch_size or global_batch(spec.train, world)  # asked for, else what the layout makes
    odd = [size for size in range(fewest, world) if total % (micro * size)]
    if odd:
        whole = micro * math.lcm(*range(fewest, world + 1))
        problems.append(
            f"launch.min_workers={fewest}: the global batch of {total} is not a whole number of micro-batches of "
            f"{micro} at {_sizes(odd)} workers, and every group size from {fewest} to {world} must hold it (the "
            f"accumulation is derived at each): raise launch.min_workers, or make the global batch a multiple of "
            f"{whole} (train.global_batch_size).")
    for size in range(fewest, world):
        if size in odd:
            continue
        at_size = replace(spec, train=replace(spec.train, grad_accum_steps=total // (micro * size),
                                              global_batch_size=None))
        for problem in check_fsdp_world_size(at_size, size) + check_rl(at_size, size):
            problems.append(f"launch.min_workers={fewest}: a group of {size} workers could not run this "
                            f"({problem.rstrip('.')}). Raise launch.min_workers to {size + 1}.")
    kind = spec.strategy.kind.value
    if needs_reshard(kind, kind, world, fewest):
        offload = any(o.value != "none" for o in (spec.strategy.offload_optimizer, spec.strategy.offload_params))
        why = unsupported(kind, kind, world, spec.precision.kind.value, offload)
        if why:
            problems.append(f"launch.min_workers={fewest}: a smaller group resumes the checkpoints on another world "
                            f"size, which this run cannot ({why}). Remove launch.min_workers.")
    return problems


def freeze_global_batch(spec: RunSpec, world: int) -> None:
    """An elastic run's frozen spec names its global batch (train.global_batch_size), so
    each group derives its accumulation from it whatever its size (the launcher's world is
    the largest group)."""
    if spec.launch.min_workers is not None:
        spec.train.global_batch_size = global_batch(spec.train, world)


def _sizes(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:-1])) + (" and " if len(sizes) > 1 else "") + str(sizes[-1])
