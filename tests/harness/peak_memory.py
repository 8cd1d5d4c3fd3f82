"""The most memory a call held at once: torch's CPU allocations, counted by the profiler,
and Python's (numpy's arrays and bytes among them), counted by tracemalloc. Both are
counts of allocations, not of a process's resident pages, so they are the same from run
to run whatever else the machine does."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Peak:
    torch_bytes: int
    python_bytes: int

    @property
    def total(self) -> int:
        """An upper bound of what was held at once: the two peaks may not coincide."""
        return self.torch_bytes + self.python_bytes


def peak_memory(call: Callable[[], object]) -> Peak:
    """What `call` held at its peak, above what was allocated before it started."""
    tracemalloc.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        _, python_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The raw allocation records: the profiler's FunctionEvents fold each into the op
    # that made it, which loses the order of allocations and frees that a peak needs.
    # kineto_results is torch's own (checked on torch 2.13); a torch without it fails
    # here, and the Wan test's reference side, which must see a whole video, would too.
    records = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return Peak(peak, python_bytes)
