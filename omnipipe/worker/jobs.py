"""One request as the worker holds it, from its submission until its last event."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.stagekit.stage import StageJob, StageResult
from omnipipe.worker import tracing


@dataclass
class Job:
    request: SubmitRequest
    events: asyncio.Queue[StageEvent] = field(default_factory=asyncio.Queue)
    result: asyncio.Future[StageResult] | None = None
    stage_job: StageJob | None = None
    task: asyncio.Task[None] | None = None
    submitted: float = field(default_factory=time.monotonic)
    queued: float = 0.0
    running: bool = False
    timeline: tracing.Timeline = field(default_factory=tracing.Timeline)
    error: str = ""
    traceparent: str = ""  # the router's span, this stage's spans' parent
    admitted: bool = False  # past the pause gate: its work may start
    aborted: str = ""  # why the worker aborted it (a pause), if it did
    usage: dict[str, int] = field(default_factory=dict)  # its StageResult's, for `done`

    def __post_init__(self) -> None:
        self.timeline.mark(tracing.SUBMITTED)
