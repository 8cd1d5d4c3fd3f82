"""The transfer interface every backend implements (the message: transfer/message.py;
the mailbox: transfer/mailbox.py)."""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnipipe.transfer.auth import TransferRefused, credential_key
from omnipipe.transfer.mailbox import Mailbox
from omnipipe.transfer.message import Message

log = logging.getLogger(__name__)


class BlockTableFull(Exception):
    """The receiver has fewer free blocks than a message brings: it is refused."""


class BlockTable:
    """A receiver's preallocated block pool (a paged KV cache's layout): `num_blocks`
    rows of `block_bytes`. A message's blocks are received straight into free rows; the
    consumer owns the ids it gets in Message.block_ids and frees them when done."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.storage = torch.empty((num_blocks, block_bytes), dtype=torch.uint8)
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int, block_bytes: int) -> list[int]:
        if block_bytes != self.block_bytes:
            raise BlockTableFull(
                f"blocks of {block_bytes} bytes do not fit this table's {self.block_bytes}"
            )
        if count > len(self._free):
            raise BlockTableFull(f"block table full: {count} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, ids: list[int]) -> None:
        # Reversed: the next allocate() pops them in their order, so a message's run of
        # adjacent rows comes back whole (one UCX receive lands in it, not one per row).
        self._free.extend(reversed(ids))

    def run(self, ids: list[int]) -> torch.Tensor | None:
        """The rows `ids` as one contiguous view when they are adjacent and in order."""
        if ids and ids == list(range(ids[0], ids[0] + len(ids))):
            return self.storage[ids[0] : ids[0] + len(ids)]
        return None

    def scatter(self, ids: list[int], staged: torch.Tensor) -> None:
        """Copies `staged` (one block after another) into the rows `ids`."""
        self.storage[torch.tensor(ids)] = staged.view(len(ids), self.block_bytes)

    def rows(self, ids: list[int]) -> list[torch.Tensor]:
        return [self.storage[i] for i in ids]


@dataclass
class TransferStats:
    """Feeds worker metrics. on_transfer: after each message moved, (bytes, seconds);
    on_frame: after each transport message (one message, or a batch of several)."""

    on_transfer: Callable[[int, float], None] = lambda _n, _s: None
    on_frame: Callable[[], None] = lambda: None


class Outcome(enum.Enum):
    """What a receiver did with one message of a batch."""

    ACK = 0  # in its mailbox (or dropped unread: its request already ended there)
    REFUSED = 1  # refused, with a reason: that request fails, as when send() is refused
    # Not taken, nothing reserved: its request's queue was full just then, or it could
    # not travel in a batch. Send it alone with send(), which waits for room.
    BUSY = 2


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str = ""


ACCEPTED = Verdict(Outcome.ACK)
SEND_ALONE = Verdict(Outcome.BUSY, "not sent in a batch")


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
        block_table: BlockTable | None = None,
    ) -> None:
        self.mailbox = mailbox
        # Where messages' KV blocks land; a receiver without one refuses them.
        self.block_table = block_table
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

    def _owning_rows(self, message: Message) -> Message:
        """The message gives its KV rows back to the table if it is dropped unread."""
        if message.block_ids and self.block_table is not None:
            message.on_drop = functools.partial(self.block_table.free, list(message.block_ids))
        return message

    def _allocate_blocks(self, header: dict[str, Any]) -> list[int]:
        """Rows for a message's blocks (none when it has none); BlockTableFull if they
        do not fit."""
        blocks = header.get("blocks") or {}
        count, nbytes = int(blocks.get("count", 0)), int(blocks.get("nbytes", 0))
        if count == 0:
            return []
        if self.block_table is None:
            raise BlockTableFull("this receiver has no block table for KV blocks")
        return self.block_table.allocate(count, nbytes)

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


class Sender(ABC):
    """Sends messages to receivers by address; returns once the receiver accepted them."""

    # Messages one batch carries at most (a backend may take fewer).
    max_batch = 256

    def __init__(self, stats: TransferStats | None = None, credential: str | None = None) -> None:
        self.stats = stats or TransferStats()
        # Receivers must prove it before any tensor goes out (transfer/auth.py).
        self._key = credential_key(credential)
        # Addresses that answered a batch (they take them), and those that closed the
        # connection on their first one instead (an older version: they never will).
        self._takes_batches: set[str] = set()
        self._no_batches: set[str] = set()

    @abstractmethod
    async def send(self, address: str, message: Message) -> None: ...

    def is_local(self, address: str) -> bool:
        """True when `address` is a receiver in this process, reached by reference
        (transfer/local.py): a coalescer passes such messages straight through."""
        return False

    def takes_batches(self, address: str) -> bool:
        """False once the receiver at `address` has shown it takes no batches."""
        return address not in self._no_batches

    async def send_batch(self, address: str, messages: Sequence[Message]) -> list[Verdict]:
        """Messages to one receiver in as few transport messages as it takes, each with
        its own verdict: ACK; REFUSED with the reason (that request alone fails); or
        BUSY: not taken, send it alone with send(), which waits for room. Messages that
        cannot travel in a batch (KV blocks, or large tensors over UCX) are BUSY too.
        Raises what send() raises when the receiver cannot be reached."""
        verdicts = [SEND_ALONE] * len(messages)
        batchable = [i for i, m in enumerate(messages) if self._batchable(m)]
        if len(batchable) < 2 or not self.takes_batches(address):
            return verdicts
        groups = [
            batchable[i : i + self.max_batch] for i in range(0, len(batchable), self.max_batch)
        ]
        try:
            answers = await asyncio.gather(
                *(self._send_batch(address, [messages[i] for i in group]) for group in groups)
            )
        except TransferRefused:
            raise
        except ConnectionError as exc:
            if address in self._takes_batches:
                raise  # it took batches before: this is a real failure
            # An older receiver closes the connection on a header it cannot read, before
            # it queues anything: each message goes again, alone.
            log.warning(
                "%s takes no batches (%s): sending to it one message at a time", address, exc
            )
            self._no_batches.add(address)
            return [Verdict(Outcome.BUSY, f"{address} takes no batches")] * len(messages)
        self._takes_batches.add(address)
        for group, answer in zip(groups, answers, strict=True):
            for i, verdict in zip(group, answer, strict=True):
                verdicts[i] = verdict
        return verdicts

    def _batchable(self, message: Message) -> bool:
        """Whether this backend carries the message in a batch (KV blocks never are: they
        land straight in the receiver's block table, one allocation per message)."""
        return False

    async def _send_batch(self, address: str, messages: list[Message]) -> list[Verdict]:
        """One transport message carrying `messages` (batchable, at most max_batch), and
        the receiver's verdict on each. Raises ConnectionError when the receiver closes
        the connection instead of answering."""
        raise NotImplementedError

    @abstractmethod
    async def close(self) -> None: ...


def split_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"{address!r} is not a {scheme} address")
    host, _, port = address.removeprefix(prefix).rpartition(":")
    return host.strip("[]"), int(port)
