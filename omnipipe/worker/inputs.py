"""A request's inputs from its upstream stages: the chunks the mailbox holds for it, and
the KV rows of the receiver's BlockTable that they carry, given back when it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from omnipipe.api.wire import SubmitRequest
from omnipipe.stagekit.stage import StageJob, Tensors
from omnipipe.transfer import Mailbox, Message
from omnipipe.worker import tracing
from omnipipe.worker.engine_thread import EngineThread

log = logging.getLogger(__name__)


class StageInputs:
    def __init__(self, mailbox: Mailbox, engine: EngineThread) -> None:
        self._mailbox = mailbox
        self._engine = engine
        # Per request: what gives its received KV rows back to the receiver's BlockTable.
        self._row_releases: dict[str, list[Callable[[], None]]] = {}

    async def messages(self, request: SubmitRequest) -> AsyncIterator[Message]:
        """The request's chunks from its upstream stages, until each has sent its last."""
        pending = set(request.inputs)
        while pending:
            message = await self._mailbox.get(request.request_id)
            if message.source not in pending:
                log.warning(
                    "request %s: unexpected input from %s", request.request_id, message.source
                )
                continue
            yield message
            if message.final:
                pending.discard(message.source)

    async def collect(
        self, request: SubmitRequest, job: StageJob, timeline: tracing.Timeline
    ) -> None:
        """Fills the job's inputs, and its KV blocks (rows of the receiver's BlockTable,
        which free_rows gives back)."""
        inputs: dict[str, Tensors] = {name: {} for name in request.inputs}
        try:
            async for message in self.messages(request):
                if message.received_ns is not None:
                    timeline.mark_first(tracing.FIRST_INPUT, message.received_ns[0])
                inputs[message.source].update(message.tensors)
                if message.blocks:
                    job.blocks.setdefault(message.source, []).extend(message.blocks)
                    if message.on_drop is not None:
                        self._row_releases.setdefault(request.request_id, []).append(
                            message.on_drop
                        )
        finally:
            job.inputs = inputs

    def free_rows(self, request_id: str) -> None:
        """After whatever the engine thread is running now (it may still read the rows):
        the engine's FIFO runs this after it, and the table is touched on the loop."""
        releases = self._row_releases.pop(request_id, [])
        if not releases:
            return
        loop = asyncio.get_running_loop()

        def release_on_loop() -> None:
            for release in releases:
                loop.call_soon_threadsafe(release)

        self._engine.run_later(release_on_loop)
