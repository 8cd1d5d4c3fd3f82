"""Steps a streaming stage's open sessions on the engine thread: every session waiting to
step (up to maxBatch, first come first stepped) in one engine call, where the stage's
step_sessions() may run them as one forward (code2wav decodes equal-length chunks of
several requests together). While a call runs, the next sessions to step gather, so the
batch grows with the load and a lone request never waits for company."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StepOutcome,
    StepResult,
    StreamingStage,
)

log = logging.getLogger(__name__)
SessionStep = tuple[Session, Sequence[Chunk]]
RunOnEngine = Callable[
    [
        Callable[[Sequence[SessionStep]], list[StepOutcome]],
        Sequence[SessionStep],
    ],
    Awaitable[list[StepOutcome]],
]


@dataclass
class _Waiting:
    session: Session
    chunks: Sequence[Chunk]
    result: asyncio.Future[StepResult | None]


class SessionStepper:
    """The engine-thread side of a streaming stage's sessions: each request's coroutine
    awaits its session's step here, and one drain task makes up the engine calls."""

    def __init__(self, stage: StreamingStage, run_on_engine: RunOnEngine, limit: int) -> None:
        self._stage = stage
        self._run_on_engine = run_on_engine
        self._limit = limit  # sessions one call steps at most (the stage's maxBatch)
        self._waiting: list[_Waiting] = []
        self._drain: asyncio.Task[None] | None = None

    async def step(self, session: Session, chunks: Sequence[Chunk]) -> StepResult | None:
        """The session's step on these chunks, run with whatever else is waiting. A caller
        cancelled before its step was taken is dropped from the call, so a session is
        never stepped after it is closed."""
        result: asyncio.Future[StepResult | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(session, chunks, result))
        if self._drain is None:
            self._drain = asyncio.create_task(self._run(), name="session-steps")
        return await result

    async def _run(self) -> None:
        taken: list[_Waiting] = []
        try:
            while True:
                live = [w for w in self._waiting if not w.result.done()]
                taken, self._waiting = live[: self._limit], live[self._limit :]
                if not taken:
                    return
                try:
                    results = await self._run_on_engine(
                        self._stage.step_sessions, [(w.session, w.chunks) for w in taken]
                    )
                except Exception as exc:  # the call itself failed: each step with it
                    results = [exc] * len(taken)
                for waiting, outcome in zip(taken, results, strict=True):
                    if waiting.result.done():
                        continue  # its caller was cancelled meanwhile
                    if isinstance(outcome, Exception):
                        waiting.result.set_exception(outcome)
                    else:
                        waiting.result.set_result(outcome)
                # Let the sessions just stepped come back for their next step before the
                # next call is made up, or it would hold only those that sat this one
                # out. A session whose step only put events on its (unbounded) queue is
                # back by then; one that waits on a hand-off's send joins a later call.
                await asyncio.sleep(0)
        except Exception as exc:  # a bug in the drain itself: every caller hears of it
            log.exception("stepping the open sessions failed")
            self._settle(taken + self._waiting, exc)
        finally:
            # Cancelled (the runtime closing): no caller waits for ever.
            self._drain = None
            self._settle(taken + self._waiting, None)
            self._waiting = []

    @staticmethod
    def _settle(waiting: list[_Waiting], error: Exception | None) -> None:
        for w in waiting:
            if w.result.done():
                continue
            if error is None:
                w.result.cancel()
            else:
                w.result.set_exception(error)
