"""Pure replica choice: the least-loaded ready replica, ties broken by rotation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    url: str
    ready: bool
    load: int  # reported running + waiting, plus what this router dispatched since
    transfer_address: str | None
    revision: str = ""  # the pipeline revision the replica runs, as it reports it


def choose(replicas: Sequence[ReplicaLoad], rotation: int, max_load: int) -> ReplicaLoad | None:
    """None when no replica is ready or every ready one is full."""
    ready = [r for r in replicas if r.ready and r.transfer_address and r.load < max_load]
    if not ready:
        return None
    least = min(r.load for r in ready)
    tied = [r for r in ready if r.load == least]
    return tied[rotation % len(tied)]


def choose_revision(
    stages: Mapping[str, Sequence[ReplicaLoad]], preferred: Sequence[str], max_load: int
) -> str | None:
    """The revision a request runs on, for every stage it uses: one with a ready replica
    of every stage, the first of `preferred` (newest first) when one qualifies, and one
    with room in every stage before one that would answer 429. None when no revision is
    whole yet (the caller waits for one)."""
    whole: set[str] | None = None
    for replicas in stages.values():
        here = {r.revision for r in replicas if r.ready and r.transfer_address}
        whole = here if whole is None else whole & here
    if not whole:
        return None

    def has_room(revision: str) -> bool:
        return all(
            choose([r for r in replicas if r.revision == revision], 0, max_load) is not None
            for replicas in stages.values()
        )

    rank = {r: i for i, r in enumerate(preferred)}
    ordered = sorted(whole, key=lambda r: (rank.get(r, len(rank)), r))
    return next((r for r in ordered if has_room(r)), ordered[0])
