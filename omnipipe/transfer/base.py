"""The transfer interface every backend implements, and the bounded mailbox."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from omnipipe.transfer.auth import credential_key


@dataclass
class Message:
    """One chunk of one request's output, from one stage to the next."""

    request_id: str
    source: str
    tensors: dict[str, torch.Tensor]
    chunk: int = 0
    final: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class TransferStats:
    """Called after each message moved: (bytes, seconds). Feeds worker metrics."""

    on_transfer: Callable[[int, float], None] = lambda _n, _s: None


# Unclaimed inputs: data may arrive before its submission, but the router submits to
# every stage at once, so inputs nobody asked for within this long belong to a request
# that failed elsewhere.
DEFAULT_TTL_SECONDS = 120.0
# What a worker's mailbox may hold at most, queued and being received together.
DEFAULT_MAX_BYTES = 1 << 30


class MailboxFull(Exception):
    """A message would take the mailbox over its byte cap: it is refused, not queued."""


class Mailbox:
    """Per-request bounded queues under one byte cap.

    A full request queue makes the receiver stop reading, which stops the sender:
    back-pressure instead of unbounded buffering. Room for a message is reserved from its
    header before its tensors are read, so the cap holds for what is being received too;
    a message that does not fit is refused (MailboxFull) and the sender gets the reason.
    Inputs nobody claims within `ttl_seconds` are dropped by sweep()."""

    def __init__(
        self,
        per_request: int = 8,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._per_request = per_request
        self._ttl = ttl_seconds
        self.max_bytes = max_bytes
        self._bytes = 0
        self._queues: dict[str, asyncio.Queue[tuple[Message, int]]] = {}
        # Requests with inputs that no job has asked for yet: when the first arrived.
        self._unclaimed: dict[str, float] = {}
        # Requests already finished here: late chunks for them (an upstream stage still
        # streaming after this one stopped) are dropped, not queued until full.
        self._closed: dict[str, float] = {}

    @property
    def bytes_held(self) -> int:
        """Bytes queued or reserved for messages being received."""
        return self._bytes

    def reserve(self, request_id: str, nbytes: int) -> int | None:
        """Room for one message of `nbytes` (tensors and header) before it is read.

        Returns the charge to hand to put() (or release()), None when the request already
        ended here (read the message and drop it), and raises MailboxFull when it does
        not fit under the cap."""
        if request_id in self._closed:
            return None
        if self._bytes + nbytes > self.max_bytes:
            raise MailboxFull(
                f"mailbox full: a {nbytes}-byte message for request {request_id} would "
                f"exceed the {self.max_bytes}-byte cap ({self._bytes} bytes held)"
            )
        self._bytes += nbytes
        return nbytes

    def release(self, charge: int) -> None:
        self._bytes -= charge

    def _queue(self, request_id: str) -> asyncio.Queue[tuple[Message, int]]:
        q = self._queues.get(request_id)
        if q is None:
            q = self._queues[request_id] = asyncio.Queue(self._per_request)
            self._unclaimed[request_id] = time.monotonic()
        return q

    async def put(self, message: Message, charge: int | None = None) -> None:
        """Queue a message; waits while the request's queue is full. Without a charge
        from reserve(), room is reserved here (and MailboxFull raised)."""
        if charge is None:
            charge = self.reserve(message.request_id, message.nbytes)
            if charge is None:
                return
        if message.request_id in self._closed:
            self.release(charge)
            return
        queue = self._queue(message.request_id)
        try:
            await queue.put((message, charge))
        except BaseException:
            self.release(charge)
            raise
        if self._queues.get(message.request_id) is not queue:
            # discard() ran while we waited for room: nobody will ever take it.
            self.release(charge)

    async def get(self, request_id: str) -> Message:
        queue = self._queue(request_id)
        self._unclaimed.pop(request_id, None)
        message, charge = await queue.get()
        self.release(charge)
        return message

    def discard(self, request_id: str) -> None:
        """The request is over here: drop what it holds and whatever still arrives."""
        queue = self._queues.pop(request_id, None)
        self._unclaimed.pop(request_id, None)
        self._closed[request_id] = time.monotonic()
        while queue is not None and not queue.empty():
            _, charge = queue.get_nowait()  # frees a receiver blocked on the full queue
            self.release(charge)

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


class Receiver(ABC):
    """Accepts messages from upstream stages into a Mailbox."""

    scheme: str = ""

    def __init__(
        self,
        mailbox: Mailbox,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        stats: TransferStats | None = None,
        credential: str | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.stats = stats or TransferStats()
        self._host, self._port = host, port
        self._advertise = advertise_host or host
        # Senders must prove it before anything they send is read (transfer/auth.py).
        self._key = credential_key(credential)
        # The socket address the listener is bound to, once started.
        self.bound: tuple[str, int] | None = None

    @property
    def address(self) -> str:
        """Where senders reach this receiver, e.g. tcp://10.0.0.5:8101."""
        return f"{self.scheme}://{self._advertise}:{self._port}"

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


class Sender(ABC):
    """Sends messages to receivers by address; returns once the receiver accepted them."""

    def __init__(self, stats: TransferStats | None = None, credential: str | None = None) -> None:
        self.stats = stats or TransferStats()
        # Receivers must prove it before any tensor goes out (transfer/auth.py).
        self._key = credential_key(credential)

    @abstractmethod
    async def send(self, address: str, message: Message) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


def split_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"{address!r} is not a {scheme} address")
    host, _, port = address.removeprefix(prefix).rpartition(":")
    return host.strip("[]"), int(port)
