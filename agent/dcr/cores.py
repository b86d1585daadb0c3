"""How many CPUs this process may use: the default thread count of work that scales with
cores (an owner's diff threads).

``os.cpu_count()`` counts the machine's, which a pod's CPU limit or a CPU set does not
change: 64 threads in a 4-CPU container are throttled, not faster. The answer is the
affinity mask, capped by the cgroup's CPU quota rounded up (a 1.5-CPU limit keeps two
threads busy between throttles), and never below 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None without one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cores(root: Path = CGROUP) -> int:
    """The CPUs this process may run on, capped by its cgroup's quota; at least 1."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)
