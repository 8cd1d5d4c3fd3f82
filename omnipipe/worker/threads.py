"""The worker's CPU thread budget, set once before any model loads.

Several workers share a machine (`omnipipe serve`) or a pod's CPU limit. Left alone, each
torch and OpenMP runtime starts one thread per core it sees, so on 2 cores three workers
run 6 busy threads, and every OpenMP barrier waits for a thread that is parked behind
another process's. The budget comes from, in order: the launcher's split
(--threads), OMP_NUM_THREADS when the stage's env sets it, the stage's resources.cpu,
the CPU quota of this cgroup, and the CPUs this process may run on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from omnipipe.api.cpus import cores_of, split_group_threads, threads_for, usable_cpus
from omnipipe.api.roles import Engine

if TYPE_CHECKING:
    from omnipipe.api import ResolvedPipeline

log = logging.getLogger(__name__)


def thread_budget(configured: int | None, stage_cpu: str | None) -> int:
    if configured is not None:
        return configured
    # A stage's env may set it (spec.stages[].env): the user's word wins over a guess.
    with contextlib.suppress(ValueError):
        if (given := int(os.environ.get("OMP_NUM_THREADS", ""))) >= 1:
            return given
    try:
        cores = cores_of(stage_cpu)
    except ValueError:
        log.warning("resources.cpu %r is no CPU quantity; sizing threads to the CPUs", stage_cpu)
        cores = None
    return min(threads_for(cores), usable_cpus()) if cores is not None else usable_cpus()


def budget_environment(threads: int) -> dict[str, str]:
    """The variables that size OpenMP, MKL, OpenBLAS and the tokenizers' Rayon pool. They
    must be in the environment before torch loads: OpenMP reads them once, and a thread
    started later (the engine thread) takes its team size from them, not from a
    set_num_threads on another thread (vLLM's CPU attention checks the two agree)."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
        "RAYON_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def apply_thread_budget(threads: int) -> None:
    """Size every pool this process runs: the environment (for runtimes not yet loaded)
    and torch's intra-op and inter-op pools."""
    os.environ.update(budget_environment(threads))
    import torch

    torch.set_num_threads(threads)
    # Inter-op parallelism runs independent ops side by side: the engine thread runs one
    # graph at a time, so one inter-op thread is all it uses. Settable once per process.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    log.info("CPU threads: %d (torch intra-op, OpenMP, MKL)", threads)


def group_teams(pipeline: ResolvedPipeline, stages: tuple[str, ...], total: int) -> dict[str, int]:
    """Each stage's thread team in a colocated group's process of `total` threads."""
    return split_group_threads(total, {s: pipeline.stage(s).cpu for s in stages})


def group_budget(configured: int | None) -> int:
    """A colocated group's process budget: the launcher's --threads, else (in a pod,
    where none is given) OMP_NUM_THREADS or the CPUs the process may use; never a
    stage's resources.cpu, which sizes that stage's team within it."""
    return thread_budget(configured, None)


def process_team(pipeline: ResolvedPipeline, teams: dict[str, int]) -> int:
    """The team a colocated group's process starts every thread with (the environment
    OpenMP reads): its vLLM stage's, where it has one, since vLLM sizes its pools from
    the environment; else the largest. Each stage's engine thread then sets its own."""
    on_vllm = [s for s in teams if pipeline.stage(s).engine is Engine.VLLM]
    return teams[on_vllm[0]] if on_vllm else max(teams.values())


def set_thread_team(threads: int) -> None:
    """On the calling thread: size its torch/OpenMP team. With torch's OpenMP backend the
    team size is per thread, so colocated stages' engine threads each keep their share.

    torch._C's own setter, not `torch.set_num_threads`: a vLLM stage's CPU worker replaces
    that module attribute process-wide with a no-op once it binds its threads, which would
    leave every stage loaded after it in the group on the process's team. The call sizes
    only the calling thread, so the vLLM engine thread's binding stays as it is."""
    import torch

    torch._C.set_num_threads(threads)
