"""What a route hears of a running request: its results, whole or in pieces, each
emitting stage's end, and a stepped stage's progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What hears a stepped stage's progress: (stage, steps done, steps in all).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Output:
    """One user-visible result event of a request: which stage made it, and what. From
    stream_parts(), data leaves out the fields that came before it as OutputParts."""

    stage: str
    data: dict[str, Any]
    index: int = 0


@dataclass(frozen=True)
class OutputPart:
    """A piece of a long string field (key) of a result still arriving."""

    stage: str
    index: int
    key: str
    text: str


@dataclass(frozen=True)
class StageDone:
    """A stage finished this request (from stream_parts(..., stage_done=True)), with
    what it counted of it (api/wire.py usage_counts)."""

    stage: str
    usage: dict[str, int] = field(default_factory=dict)
