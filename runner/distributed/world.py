"""How many processes a run has: planned by the launcher, or given by an outside launch."""

from __future__ import annotations

import os

import torch

from runner.config.spec import LaunchSpec
from runner.distributed.process_group import joined_launch


def resolve_nproc(launch: LaunchSpec) -> int:
    if launch.nproc_per_node != "auto":
        return int(launch.nproc_per_node)
    return max(torch.cuda.device_count(), 1)


def world_size(launch: LaunchSpec) -> int:
    joined = joined_launch()
    return joined.world_size if joined else resolve_nproc(launch) * launch.nnodes


# The world size the launcher planned (and validated the batch arithmetic for), handed to
# its workers: the engagement check compares Accelerate's process count with it.
PLANNED_WORLD_SIZE_ENV = "RUNNER_PLANNED_WORLD_SIZE"


def planned_world_size(launch: LaunchSpec) -> int:
    """In a worker: the launcher's plan; a follower of an outside launch has only its WORLD_SIZE."""
    planned = os.environ.get(PLANNED_WORLD_SIZE_ENV)
    return int(planned) if planned else world_size(launch)
