"""How many CPU threads a rank's torch ops may use.

A CPU rank that runs more threads than it has cores is slower, not faster: on a shared machine
the threads wait for each other at every op. The count, first that applies:
1. the `cpu_threads` setting;
2. `OMP_NUM_THREADS` (the user's, per process, as OpenMP reads it);
3. the cores this process may run on, shared among the `tp` ranks: the CPU affinity
   (`os.sched_getaffinity`, e.g. `taskset`), capped by the cgroup CPU quota (a container's
   `--cpus`: cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`).
This module imports nothing heavy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")


class ThreadChoice(NamedTuple):
    threads: int
    source: str  # what decided it: "cpu_threads", "OMP_NUM_THREADS" or "available cores"


def _env_threads(env: Mapping[str, str]) -> Optional[int]:
    """OMP_NUM_THREADS as a positive int; None when unset or not one (OpenMP ignores such a
    value too; a list such as "4,2" gives its first level)."""
    raw = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 1 else None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> Optional[float]:
    """The CPUs the cgroup quota allows (quota / period, e.g. 1.5), or None without a quota.
    Reads cgroup v2 (`cpu.max`: "max 100000" or "150000 100000") at `root`, else v1
    (`cpu/cpu.cfs_quota_us`, -1 for none, and `cpu/cpu.cfs_period_us`)."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" /
                                                                     "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> Optional[float]:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def available_cores(affinity: Optional[Sequence[int]] = None,
                    cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: its affinity set (`os.cpu_count()` where the platform
    has no affinity), capped by the cgroup quota rounded up; at least 1."""
    if affinity is None:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = range(os.cpu_count() or 1)
    cores = len(affinity)
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def choose_threads(requested: Optional[int], tp: int, env: Optional[Mapping[str, str]] = None,
                   affinity: Optional[Sequence[int]] = None,
                   cgroup_root: Path = CGROUP_ROOT) -> ThreadChoice:
    """The torch thread count of one of `tp` ranks (see the module docstring for the order)."""
    if requested is not None:
        return ThreadChoice(requested, "cpu_threads")
    from_env = _env_threads(os.environ if env is None else env)
    if from_env is not None:
        return ThreadChoice(from_env, "OMP_NUM_THREADS")
    return ThreadChoice(max(1, available_cores(affinity, cgroup_root) // tp), "available cores")
