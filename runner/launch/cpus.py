"""How many CPUs this process may really use: affinity and cgroup quota, not os.cpu_count().

os.cpu_count() counts the machine's cores. Under Slurm (`--cpus-per-task`), taskset,
or a container with a CPU limit, a process may use far fewer; threads sized to the
machine then oversubscribe the few cores it has and every step slows down.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cgroup_quota(root: Path) -> float:
    """CPUs allowed by the cgroup's CFS quota (v2 cpu.max, or v1 cfs_quota_us); inf if none."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return math.inf if quota == "max" else int(quota) / int(period)
        v1_quota, v1_period = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if v1_quota.is_file() and v1_period.is_file():
            quota = int(v1_quota.read_text())
            return math.inf if quota <= 0 else quota / int(v1_period.read_text())
    except (OSError, ValueError):
        pass  # unreadable or unexpected: no quota known, the affinity alone decides
    return math.inf


def usable_cpus(cgroup_root: Optional[Path] = None) -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded up)."""
    quota = _cgroup_quota(cgroup_root or CGROUP_ROOT)
    cpus = _affinity()
    return max(1, min(cpus, math.ceil(quota)) if quota != math.inf else cpus)
