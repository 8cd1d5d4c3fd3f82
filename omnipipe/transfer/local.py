"""Hand-offs by reference between stages of one process (docs/design/colocation.md,
section 3).

The group host makes one LocalExchange and hands it to every member: each registers its
receiver's advertised address with its mailbox. LocalFirstSender delivers to those
addresses without a socket, doing what TcpReceiver._receive_one does (reserve, refuse or
drop, then put, which waits while the request's queue is full), and sends everything
else through the network sender it wraps (another group, or another replica).

The contract this adds: a stage writes neither into a tensor it handed off nor into one
it received. With OMNIPIPE_TRANSFER_CHECK_ALIASING=1 the exchange's check() names any
tensor delivered by reference and written in place since (transfer/aliasing.py)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnipipe.transfer import batch
from omnipipe.transfer.aliasing import CHECK_ALIASING_ENV, AliasingCheck
from omnipipe.transfer.auth import TransferRefused
from omnipipe.transfer.base import (
    ACCEPTED,
    Outcome,
    Sender,
    TransferStats,
    Verdict,
)
from omnipipe.transfer.mailbox import Charge, Mailbox, MailboxFull
from omnipipe.transfer.message import Message, stamp_received


@dataclass(frozen=True)
class LocalPeer:
    """A co-located receiver: its mailbox, and the stats its stage counts inputs with."""

    mailbox: Mailbox
    stats: TransferStats


class LocalExchange:
    """Receivers of this process by advertised address (tcp://127.0.0.1:8102, say)."""

    def __init__(self, check_aliasing: bool | None = None) -> None:
        """`check_aliasing`: None reads $OMNIPIPE_TRANSFER_CHECK_ALIASING ("1": on)."""
        if check_aliasing is None:
            check_aliasing = os.environ.get(CHECK_ALIASING_ENV) == "1"
        self._aliasing = AliasingCheck() if check_aliasing else None
        self._peers: dict[str, LocalPeer] = {}

    def register(self, address: str, mailbox: Mailbox, stats: TransferStats | None = None) -> None:
        self._peers[address] = LocalPeer(mailbox, stats or TransferStats())

    def unregister(self, address: str) -> None:
        self._peers.pop(address, None)

    def knows(self, address: str) -> bool:
        return address in self._peers

    def peer(self, address: str) -> LocalPeer:
        """KeyError for an address that is not registered."""
        return self._peers[address]

    def record(
        self,
        source: str,
        address: str,
        request_id: str,
        key: str,
        sent: torch.Tensor,
        received: torch.Tensor,
    ) -> None:
        """`received` shares `sent`'s memory: remembered when checking aliasing."""
        if self._aliasing is not None:
            self._aliasing.record(source, address, request_id, key, sent, received)

    def check(self) -> None:
        """AliasingError if a tensor delivered by reference was written in place since
        (nothing is recorded unless checking aliasing)."""
        if self._aliasing is not None:
            self._aliasing.check()


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _charged_bytes(message: Message) -> int:
    """What the mailbox cap counts: its tensors and, in place of BlockTable rows, its
    KV blocks."""
    return message.nbytes + sum(_tensor_bytes(b) for b in message.blocks)


def _by_reference(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor to deliver, and whether it shares the sender's memory. A view or a
    slice is compacted: it would pin its whole base while the mailbox charged the view."""
    t = tensor.detach()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == _tensor_bytes(t)
    ):
        return t, True
    return t.clone(memory_format=torch.contiguous_format), False


def _finish_device_work(tensors: Sequence[torch.Tensor]) -> None:
    """The receiving stage may read on another stream or thread: the work that wrote
    each CUDA tensor (and the compacting clones) must be done first. CPU-only runs never
    touch CUDA."""
    devices = {t.device for t in tensors if t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


class LocalFirstSender(Sender):
    """Delivers to addresses the exchange knows by reference; the rest go to `network`.

    `on_local(nbytes)`: once per message delivered locally, its tensor and KV block
    bytes (the local hand-off counters). The receiving peer's stats get on_transfer
    with the tensor bytes and the delivery's seconds, as its receiver would report them;
    `stats` (by default the network sender's) counts nothing local, so the network
    counters keep counting only what crossed a socket."""

    def __init__(
        self,
        network: Sender,
        exchange: LocalExchange,
        stats: TransferStats | None = None,
        on_local: Callable[[int], None] = lambda _n: None,
    ) -> None:
        super().__init__(stats or network.stats)
        self.network = network
        self.exchange = exchange
        self.on_local = on_local
        self.max_batch = network.max_batch

    def is_local(self, address: str) -> bool:
        return self.exchange.knows(address)

    def takes_batches(self, address: str) -> bool:
        return self.is_local(address) or self.network.takes_batches(address)

    async def send(self, address: str, message: Message) -> None:
        if not self.exchange.knows(address):
            await self.network.send(address, message)
            return
        peer = self.exchange.peer(address)
        started = time.perf_counter()
        try:
            charge = peer.mailbox.reserve(message.request_id, _charged_bytes(message))
        except MailboxFull as exc:
            raise TransferRefused(f"{address} refused request {message.request_id}: {exc}") from exc
        if charge is None:  # the request already ended there: a late chunk
            return
        try:
            delivered = self._copy(address, message)
            _finish_device_work([*delivered.tensors.values(), *delivered.blocks])
        except BaseException:
            peer.mailbox.release(charge)
            raise
        seconds = stamp_received(delivered, started)
        await peer.mailbox.put(delivered, charge)
        self._count(peer, message, delivered, seconds)

    async def send_batch(self, address: str, messages: Sequence[Message]) -> list[Verdict]:
        """As over TCP, none waits for room: a message whose request's queue is full now
        is BUSY (HandOffs sends it again alone, which waits)."""
        if not self.exchange.knows(address):
            return await self.network.send_batch(address, messages)
        peer = self.exchange.peer(address)
        started = time.perf_counter()
        verdicts: list[Verdict] = []
        admitted: list[tuple[int, Message, Charge]] = []
        try:
            for i, message in enumerate(messages):
                room = batch.admit(peer.mailbox, message.request_id, _charged_bytes(message))
                if isinstance(room, Charge):
                    admitted.append((i, self._copy(address, message), room))
                verdicts.append(room if isinstance(room, Verdict) else ACCEPTED)
            _finish_device_work(
                [t for _, m, _ in admitted for t in (*m.tensors.values(), *m.blocks)]
            )
        except BaseException:
            for _, _, charge in admitted:
                peer.mailbox.release(charge)
            raise
        for i, delivered, charge in admitted:
            seconds = stamp_received(delivered, started)
            verdicts[i] = batch.deliver(peer.mailbox, delivered, charge)
            if verdicts[i].outcome is Outcome.ACK:
                self._count(peer, messages[i], delivered, seconds)
        return verdicts

    def _copy(self, address: str, message: Message) -> Message:
        """The receiver's own message: its own dicts and list, tensors by reference
        where that pins nothing else. Blocks go without ids or on_drop: no BlockTable
        row is taken, and the mailbox charge covers them."""
        tensors: dict[str, torch.Tensor] = {}
        shared: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for key, tensor in message.tensors.items():
            tensors[key], by_reference = _by_reference(tensor)
            if by_reference:
                shared.append((key, tensor, tensors[key]))
        blocks = []
        for i, block in enumerate(message.blocks):
            delivered, by_reference = _by_reference(block)
            blocks.append(delivered)
            if by_reference:
                shared.append((f"blocks[{i}]", block, delivered))
        for key, sent, received in shared:
            self.exchange.record(message.source, address, message.request_id, key, sent, received)
        return Message(
            message.request_id,
            message.source,
            tensors,
            chunk=message.chunk,
            final=message.final,
            meta=copy.deepcopy(message.meta),
            blocks=blocks,
        )

    def _count(self, peer: LocalPeer, sent: Message, delivered: Message, seconds: float) -> None:
        self.on_local(_charged_bytes(sent))
        peer.stats.on_transfer(delivered.nbytes, seconds)

    async def close(self) -> None:
        await self.network.close()
