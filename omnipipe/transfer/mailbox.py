"""The bounded mailbox a receiver puts messages in, per request, under one byte cap."""

from __future__ import annotations

import asyncio
import time

from omnipipe.transfer.message import Message

# Unclaimed inputs: data may arrive before its submission, but the router submits to
# every stage at once, so inputs nobody asked for within this long belong to a request
# that failed elsewhere.
DEFAULT_TTL_SECONDS = 120.0
# What a worker's mailbox may hold at most, queued and being received together.
DEFAULT_MAX_BYTES = 1 << 30
# The part of the cap that inputs no job has claimed yet may hold. The rest is kept for
# requests a job is waiting on, so that a flood of inputs for requests that never come
# (or a surge of new ones) cannot starve the requests already running.
UNCLAIMED_SHARE = 0.75
# What a refusal for lack of unclaimed room says: a sender whose request's submission has
# not reached the receiver yet tries again shortly (HandOffs), since its claim frees it.
UNCLAIMED = "which no job has claimed yet"


class MailboxFull(Exception):
    """A message would take the mailbox over its byte cap: it is refused, not queued."""


class Charge(int):
    """Bytes reserved for one message (an int), and for which request; `unclaimed`: they
    count against the unclaimed share."""

    request_id: str
    unclaimed: bool

    def __new__(cls, nbytes: int, request_id: str, unclaimed: bool) -> Charge:
        charge = super().__new__(cls, nbytes)
        charge.request_id, charge.unclaimed = request_id, unclaimed
        return charge


class Mailbox:
    """Per-request bounded queues under one byte cap.

    A full request queue makes the receiver stop reading, which stops the sender:
    back-pressure instead of unbounded buffering. Room for a message is reserved from its
    header before its tensors are read, so the cap holds for what is being received too;
    a message that does not fit is refused (MailboxFull) and the sender gets the reason.
    A request is claimed once a job asks for its inputs (get()); inputs of requests not
    claimed yet hold at most `UNCLAIMED_SHARE` of the cap, and are dropped by sweep()
    when nobody claims them within `ttl_seconds`."""

    def __init__(
        self,
        per_request: int = 8,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._per_request = per_request
        self._ttl = ttl_seconds
        self.max_bytes = max_bytes
        self.max_unclaimed_bytes = int(max_bytes * UNCLAIMED_SHARE)
        self._bytes = 0
        self._unclaimed_bytes = 0
        self._queues: dict[str, asyncio.Queue[tuple[Message, Charge]]] = {}
        # Requests with inputs that no job has asked for yet: when the first arrived, and
        # the bytes they hold (queued or being received).
        self._unclaimed: dict[str, float] = {}
        self._unclaimed_held: dict[str, int] = {}
        # Requests already finished here: late chunks for them (an upstream stage still
        # streaming after this one stopped) are dropped, not queued until full.
        self._closed: dict[str, float] = {}

    @property
    def bytes_held(self) -> int:
        """Bytes queued or reserved for messages being received."""
        return self._bytes

    @property
    def unclaimed_bytes_held(self) -> int:
        """Of bytes_held, those of requests no job has claimed yet."""
        return self._unclaimed_bytes

    def _claimed(self, request_id: str) -> bool:
        return request_id in self._queues and request_id not in self._unclaimed

    def reserve(self, request_id: str, nbytes: int) -> Charge | None:
        """Room for one message of `nbytes` (tensors and header) before it is read.

        Returns the charge to hand to put() (or release()), None when the request already
        ended here (read the message and drop it), and raises MailboxFull when it does
        not fit under the cap, or, for a request not claimed yet, under the unclaimed
        share of it."""
        if request_id in self._closed:
            return None
        if self._bytes + nbytes > self.max_bytes:
            raise MailboxFull(
                f"mailbox full: a {nbytes}-byte message for request {request_id} would "
                f"exceed the {self.max_bytes}-byte cap ({self._bytes} bytes held)"
            )
        unclaimed = not self._claimed(request_id)
        if unclaimed and self._unclaimed_bytes + nbytes > self.max_unclaimed_bytes:
            raise MailboxFull(
                f"mailbox full: a {nbytes}-byte message for request {request_id}, {UNCLAIMED}, "
                f"would exceed the {self.max_unclaimed_bytes} bytes "
                f"that unclaimed inputs may hold of the {self.max_bytes}-byte cap "
                f"({self._unclaimed_bytes} bytes held unclaimed)"
            )
        self._bytes += nbytes
        if unclaimed:
            self._unclaimed_bytes += nbytes
            self._unclaimed_held[request_id] = self._unclaimed_held.get(request_id, 0) + nbytes
        return Charge(nbytes, request_id, unclaimed)

    def release(self, charge: Charge) -> None:
        self._bytes -= charge
        if charge.unclaimed and charge.request_id in self._unclaimed_held:
            self._unclaimed_bytes -= charge
            left = self._unclaimed_held[charge.request_id] - charge
            if left > 0:
                self._unclaimed_held[charge.request_id] = left
            else:
                del self._unclaimed_held[charge.request_id]

    def _unclaim_bytes(self, request_id: str) -> None:
        """The request's bytes no longer count as unclaimed (claimed, or discarded)."""
        self._unclaimed_bytes -= self._unclaimed_held.pop(request_id, 0)

    def _queue(self, request_id: str) -> asyncio.Queue[tuple[Message, Charge]]:
        q = self._queues.get(request_id)
        if q is None:
            q = self._queues[request_id] = asyncio.Queue(self._per_request)
            self._unclaimed[request_id] = time.monotonic()
        return q

    async def put(self, message: Message, charge: Charge | None = None) -> None:
        """Queue a message; waits while the request's queue is full. Without a charge
        from reserve(), room is reserved here (and MailboxFull raised)."""
        if charge is None:
            charge = self.reserve(message.request_id, message.nbytes)
            if charge is None:
                return
        if message.request_id in self._closed:
            self._drop(message, charge)
            return
        queue = self._queue(message.request_id)
        try:
            await queue.put((message, charge))
        except BaseException:
            self._drop(message, charge)
            raise
        if self._queues.get(message.request_id) is not queue:
            # discard() ran while we waited for room: nobody will ever take it.
            self._drop(message, charge)

    def _drop(self, message: Message, charge: Charge) -> None:
        self.release(charge)
        if message.on_drop is not None:
            message.on_drop()

    def has_room_now(self, request_id: str) -> bool:
        """put_nowait() would queue a message for this request without waiting."""
        queue = self._queues.get(request_id)
        return queue is None or not queue.full()

    def put_nowait(self, message: Message, charge: Charge) -> None:
        """put() for a caller that checked has_room_now(): never waits."""
        if message.request_id in self._closed:
            self._drop(message, charge)
            return
        self._queue(message.request_id).put_nowait((message, charge))

    def claim(self, request_id: str) -> None:
        """A job will take this request's inputs (get() claims too): from now on they
        neither count against the unclaimed share nor expire. Call it when the job is
        submitted, so that inputs arriving before the job first asks are not refused
        while the unclaimed share is full."""
        if request_id in self._closed:
            return
        self._queue(request_id)
        if self._unclaimed.pop(request_id, None) is not None:
            self._unclaim_bytes(request_id)

    async def get(self, request_id: str) -> Message:
        queue = self._queue(request_id)
        if self._unclaimed.pop(request_id, None) is not None:
            self._unclaim_bytes(request_id)
        message, charge = await queue.get()
        self.release(charge)
        return message

    def discard(self, request_id: str) -> None:
        """The request is over here: drop what it holds and whatever still arrives."""
        queue = self._queues.pop(request_id, None)
        self._unclaimed.pop(request_id, None)
        self._unclaim_bytes(request_id)
        self._closed[request_id] = time.monotonic()
        while queue is not None and not queue.empty():
            message, charge = queue.get_nowait()  # frees a receiver blocked on a full queue
            self._drop(message, charge)

    def sweep(self) -> int:
        """Drop inputs nobody claimed in time (a cancelled or failed request)."""
        cutoff = time.monotonic() - self._ttl
        stale = [r for r, t in self._unclaimed.items() if t < cutoff]
        for request_id in stale:
            self.discard(request_id)
        for request_id in [r for r, t in self._closed.items() if t < cutoff]:
            del self._closed[request_id]
        return len(stale)

    def __len__(self) -> int:
        return len(self._queues)
