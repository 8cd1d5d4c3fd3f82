"""The one interface of the schedulers, and what each uses of the runtime that hosts it."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnipipe.transfer.handoffs import HandOffs
from omnipipe.worker import tracing
from omnipipe.worker.engine_thread import EngineThread
from omnipipe.worker.inputs import StageInputs
from omnipipe.worker.jobs import Job
from omnipipe.worker.metrics import WorkerMetrics


@dataclass(frozen=True)
class Host:
    """What a scheduler shares with the runtime: its requests, threads and hand-offs."""

    stage_name: str
    jobs: dict[str, Job]  # the runtime's own: a request that left it is no longer wanted
    engine: EngineThread
    inputs: StageInputs
    handoffs: HandOffs
    metrics: WorkerMetrics
    max_batch: int
    batch_wait_seconds: float
    load_changed: Callable[[], None]  # after a job starts or stops running


class Scheduler(ABC):
    """One stage kind's way from an admitted request to its engine and on to the next
    stages. The runtime picks one when a stage is loaded and keeps the rest: admission,
    cancellation, errors and the request's last events."""

    def __init__(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    async def serve(self, job: Job) -> list[dict[str, Any]]:
        """The admitted job's work, up to its hand-off to the next stages; the outputs
        the client still has to hear (a streaming stage has sent its own as it went)."""

    @abstractmethod
    async def run(self) -> None:
        """The engine loop, run while the stage is loaded; it may return at once."""

    @property
    def queued(self) -> int:
        """Requests waiting in the queue for the engine."""
        return 0

    def _start(self, jobs: list[Job]) -> None:
        """Mark jobs running, with the time they waited in the queue."""
        for job in jobs:
            job.running = True
            job.timeline.mark(tracing.STARTED)
            self.host.metrics.observe_queue_wait(time.monotonic() - job.queued)
        self.host.load_changed()
