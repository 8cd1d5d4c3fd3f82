"""Pure replica choice: the least-loaded ready replica, ties broken by rotation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    url: str
    ready: bool
    load: int  # reported running + waiting, plus what this router dispatched since
    transfer_address: str | None


def choose(replicas: Sequence[ReplicaLoad], rotation: int, max_load: int) -> ReplicaLoad | None:
    """None when no replica is ready or every ready one is full."""
    ready = [r for r in replicas if r.ready and r.transfer_address and r.load < max_load]
    if not ready:
        return None
    least = min(r.load for r in ready)
    tied = [r for r in ready if r.load == least]
    return tied[rotation % len(tied)]
