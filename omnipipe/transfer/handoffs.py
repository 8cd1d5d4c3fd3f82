"""One transport message per destination per turn of the event loop (issue #25).

A streaming stage's engine call steps every waiting session at once, and each request's
coroutine then sends its chunk in the same turn of the loop. HandOffs queues those
messages per address and flushes each address once, after every coroutine woken in this
turn has run (loop.call_soon), as one batch (Sender.send_batch). Each caller waits for
its own message's verdict: a refusal fails its request alone; a message the receiver
could not take now (its request's queue is full), or that cannot travel in a batch (KV
blocks), is sent again alone through Sender.send, which waits for room as before."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from omnipipe.transfer.auth import TransferRefused
from omnipipe.transfer.base import SEND_ALONE, Outcome, Sender, Verdict
from omnipipe.transfer.mailbox import UNCLAIMED
from omnipipe.transfer.message import Message

# Seconds between tries of a hand-off refused for lack of unclaimed room (1.5 s in all):
# a submission sent at once with the input's request reaches its worker well within.
CLAIM_WAITS = (0.05, 0.1, 0.2, 0.4, 0.75)


@dataclass
class _Queued:
    message: Message
    verdict: asyncio.Future[Verdict]


class HandOffs:
    """A runtime's sends, coalesced per destination address."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self._queued: dict[str, list[_Queued]] = {}
        self._flushes: set[asyncio.Task[None]] = set()

    async def send(self, address: str, message: Message) -> None:
        await self.send_all([(address, message)])

    async def send_all(self, sends: Sequence[tuple[str, Message]]) -> None:
        """Hands each message on to its address; returns once every one was accepted.
        The messages are queued before this first waits, so a request's chunks to
        several destinations join the same flushes."""
        waits = [
            self._deliver(address, message, self._queue(address, message))
            for address, message in sends
        ]
        if len(waits) == 1:
            await waits[0]
        else:
            await asyncio.gather(*waits)

    def _queue(self, address: str, message: Message) -> asyncio.Future[Verdict]:
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[Verdict] = loop.create_future()
        if message.blocks:  # KV blocks go alone (send_batch would answer so anyway)
            verdict.set_result(SEND_ALONE)
            return verdict
        queued = self._queued.get(address)
        if queued is None:
            queued = self._queued[address] = []
            loop.call_soon(self._flush, address)
        queued.append(_Queued(message, verdict))
        return verdict

    async def _deliver(
        self, address: str, message: Message, pending: asyncio.Future[Verdict]
    ) -> None:
        verdict = await pending
        unclaimed = verdict.outcome is Outcome.REFUSED and UNCLAIMED in verdict.reason
        if verdict.outcome is Outcome.REFUSED and not unclaimed:
            raise TransferRefused(
                f"{address} refused request {message.request_id}: {verdict.reason}"
            )
        if verdict.outcome is Outcome.BUSY or unclaimed:
            await self._send_alone(address, message)

    async def _send_alone(self, address: str, message: Message) -> None:
        """Sender.send, again a few times when the receiver's room for inputs of requests
        not claimed yet is full: the router submits to every stage at once, so this input
        may have come before its request's submission, whose claim gives it room. A
        flood of inputs nobody will claim keeps that room full, and a real request's
        hand-off waits out its own submission instead of failing."""
        for pause in CLAIM_WAITS:
            try:
                await self.sender.send(address, message)
                return
            except TransferRefused as exc:
                if UNCLAIMED not in str(exc):
                    raise
            await asyncio.sleep(pause)
        await self.sender.send(address, message)

    def _flush(self, address: str) -> None:
        # A caller cancelled meanwhile takes its message back: it is never sent.
        queued = [q for q in self._queued.pop(address, []) if not q.verdict.done()]
        if len(queued) == 1:
            queued[0].verdict.set_result(SEND_ALONE)
        elif queued:
            task = asyncio.create_task(self._send_batch(address, queued))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _send_batch(self, address: str, queued: list[_Queued]) -> None:
        try:
            verdicts = await self.sender.send_batch(address, [q.message for q in queued])
        except asyncio.CancelledError:
            for q in queued:
                q.verdict.cancel()
            raise
        except Exception as exc:  # the receiver could not be reached: each request fails
            for q in queued:
                if not q.verdict.done():
                    q.verdict.set_exception(exc)
            return
        for q, verdict in zip(queued, verdicts, strict=True):
            if not q.verdict.done():
                q.verdict.set_result(verdict)

    async def close(self) -> None:
        for task in list(self._flushes):
            task.cancel()
