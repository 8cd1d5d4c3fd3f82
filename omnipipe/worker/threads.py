"""The worker's CPU thread budget, set once before any model loads.

Several workers share a machine (`omnipipe serve`) or a pod's CPU limit. Left alone, each
torch and OpenMP runtime starts one thread per core it sees, so on 2 cores three workers
run 6 busy threads, and every OpenMP barrier waits for a thread that is parked behind
another process's. The budget comes from, in order: the launcher's split
(OMNIPIPE_WORKER_THREADS), the stage's resources.cpu, the CPU quota of this cgroup, and
the CPUs this process may run on.
"""

from __future__ import annotations

import contextlib
import logging
import os

from omnipipe.api.cpus import cores_of, threads_for, usable_cpus

log = logging.getLogger(__name__)


def thread_budget(configured: int | None, stage_cpu: str | None) -> int:
    if configured is not None:
        return configured
    try:
        cores = cores_of(stage_cpu)
    except ValueError:
        log.warning("resources.cpu %r is no CPU quantity; sizing threads to the CPUs", stage_cpu)
        cores = None
    return min(threads_for(cores), usable_cpus()) if cores is not None else usable_cpus()


def apply_thread_budget(threads: int) -> None:
    """Size every pool this process runs: torch's intra-op and inter-op pools, OpenMP and
    MKL (through the environment too, for runtimes not yet loaded), and the tokenizers'
    Rayon pool, which would otherwise start one thread per core per worker."""
    import torch

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)
    # Inter-op parallelism runs independent ops side by side: the engine thread runs one
    # graph at a time, so one inter-op thread is all it uses. Settable once per process.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    log.info("CPU threads: %d (torch intra-op, OpenMP, MKL)", threads)
