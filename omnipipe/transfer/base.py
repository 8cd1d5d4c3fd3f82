"""The transfer interface every backend implements, and the bounded mailbox."""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


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


class Mailbox:
    """Per-request bounded queues. A full queue makes the receiver stop reading, which
    stops the sender: back-pressure instead of unbounded buffering."""

    def __init__(self, per_request: int = 8, ttl_seconds: float = 600.0) -> None:
        self._per_request = per_request
        self._ttl = ttl_seconds
        self._queues: dict[str, asyncio.Queue[Message]] = {}
        self._created: dict[str, float] = {}
        # Requests already finished here: late chunks for them (an upstream stage still
        # streaming after this one stopped) are dropped, not queued until full.
        self._closed: dict[str, float] = {}

    def _queue(self, request_id: str) -> asyncio.Queue[Message]:
        q = self._queues.get(request_id)
        if q is None:
            q = self._queues[request_id] = asyncio.Queue(self._per_request)
            self._created[request_id] = time.monotonic()
        return q

    async def put(self, message: Message) -> None:
        if message.request_id in self._closed:
            return
        await self._queue(message.request_id).put(message)

    async def get(self, request_id: str) -> Message:
        return await self._queue(request_id).get()

    def discard(self, request_id: str) -> None:
        """The request is over here: drop what it holds and whatever still arrives."""
        queue = self._queues.pop(request_id, None)
        self._created.pop(request_id, None)
        self._closed[request_id] = time.monotonic()
        while queue is not None and not queue.empty():
            queue.get_nowait()  # frees a receiver blocked on the full queue

    def sweep(self) -> int:
        """Drop queues nobody claimed in time (a cancelled or failed request)."""
        cutoff = time.monotonic() - self._ttl
        stale = [r for r, t in self._created.items() if t < cutoff]
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
    ) -> None:
        self.mailbox = mailbox
        self.stats = stats or TransferStats()
        self._host, self._port = host, port
        self._advertise = advertise_host or host

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

    def __init__(self, stats: TransferStats | None = None) -> None:
        self.stats = stats or TransferStats()

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
