"""How many CPU threads a stage's worker runs, shared by the local launcher (which splits
the machine) and the worker (which reads its own limit)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cores_of(quantity: str | int | None) -> float | None:
    """A Kubernetes CPU quantity ("2", "500m", "1.5") in cores; None when unset."""
    if quantity is None:
        return None
    text = str(quantity).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(f"{quantity!r} is not a CPU quantity") from None
    if cores <= 0 or not math.isfinite(cores):
        raise ValueError(f"{quantity!r} is not a positive CPU quantity")
    return cores


def threads_for(cores: float) -> int:
    """Threads for a share of `cores`: a fraction of a core still runs one thread."""
    return max(1, math.ceil(cores - 1e-9))


def split_cores(cores: int, workers: Mapping[str, int]) -> dict[str, int]:
    """Each worker's threads when `workers` (name -> count of processes) share `cores`
    on one machine: an even split, at least one each. Their thread pools then add up to
    the cores (or to one per process when there are more processes than cores), so no
    OpenMP team waits on a thread the kernel has parked for another process's."""
    processes = sum(workers.values())
    if processes == 0:
        return {}
    share = max(1, cores // processes)
    return {name: share for name in workers}


def split_group_threads(total: int, cpus: Mapping[str, str | int | None]) -> dict[str, int]:
    """Each stage's threads in a colocated group's process of `total` threads, from
    `cpus` (stage -> its resources.cpu): a stage's own cores where set, the rest split
    evenly, at least one each; the teams then add up to the process's budget, as
    split_cores does across processes."""
    fixed: dict[str, int] = {}
    for stage, cpu in cpus.items():
        try:
            cores = cores_of(cpu)
        except ValueError:
            cores = None
        if cores is not None:
            fixed[stage] = threads_for(cores)
    rest = {s: 1 for s in cpus if s not in fixed}
    return {**fixed, **split_cores(max(1, total - sum(fixed.values())), rest)}


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, threads_for(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)
