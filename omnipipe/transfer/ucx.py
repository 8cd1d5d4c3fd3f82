"""UCX backend: tensors travel as UCX tagged messages between two processes' UCX workers
(transfer/ucx_worker.py), which pick CMA, shared memory, TCP or RDMA as the hardware
allows. Imported only when selected.

ucxx's sockaddr listener takes a port only and listens on every interface, and UCX
endpoints made through it are restricted to TCP, so it is not used. Instead a TCP socket
bound to exactly the given host is the rendezvous: a sender connects, both ends prove the
pipeline credential (transfer/auth.py), then exchange UCX worker addresses; the receiver
also names a random 56-bit connection id. The socket then carries nothing: it stays open
so that either end sees the other die (the UCX endpoints run without error handling).

Tags are the connection id (see RECEIVER_MASK) shifted left 8 bits plus a kind. One
message is one round trip:
    sender -> CTRL: u32 header length, msgpack header, the tensors that fit inline;
              DATA: each large tensor from its own memory, then the KV blocks gathered
              into one buffer, all posted at once
    receiver reserves room in its mailbox (and KV rows), posts a receive for each DATA
        message straight into the buffer its tensor is built on (the blocks into their
        rows when these are adjacent, else into one buffer scattered into them), and
        once they have landed answers REPLY: ACK. Or it answers REFUSED u32 reason, or
        DROPPED (the request already ended), after receiving each DATA message into one
        byte. A connection it cannot serve, it ends by closing the rendezvous socket.
A batch (transfer/batch.py) is one CTRL message and nothing else: only messages whose
tensors all travel inline join one, and its REPLY is BATCHED, u32 length, one verdict per
message, cut to fit the reply buffer (MAX_BATCH keeps them within it).
Above UCX's rendezvous threshold (8 KiB between two processes on one host; more over
some networks) a DATA send is a rendezvous: only its announcement travels until the
receiver posts the matching receive, so nothing large reaches the receiver before it
has room, and a one-byte receive ends both sides' requests without moving the data
(UCX reports it truncated). Nothing is set up per message: endpoints live as long as
the connection, the reply buffer is the connection's, and large receive buffers come
from a pool."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnipipe.transfer import batch, ucx_worker
from omnipipe.transfer.auth import HANDSHAKE_TIMEOUT_SECONDS, REFUSED, TransferRefused, prove_peer
from omnipipe.transfer.base import Outcome, Sender, Verdict, split_address
from omnipipe.transfer.codec import MAX_HEADER, CodecError, encode_header
from omnipipe.transfer.frames import frame_header
from omnipipe.transfer.message import Message
from omnipipe.transfer.tcp import ACK, _recv_bytes, _tune
from omnipipe.transfer.ucx_worker import PeerGone, UcxWorker, array

log = logging.getLogger(__name__)

# Tensors up to this size ride in the CTRL message, while it stays under CTRL_MAX.
INLINE_MAX = 64 * 1024
# Smaller CUDA tensors ride inline too, as host bytes, and the receiver puts them back on
# their device: two small copies beat CUDA IPC's rendezvous (bench/transfer_cuda.py).
DIRECT_MIN = 64 * 1024
CTRL_MAX = MAX_HEADER + 4 + 4 * INLINE_MAX
# The request already ended here: the message was dropped unread.
DROPPED = b"\x12"
CTRL, DATA, REPLY = 1, 2, 3
# A connection id is 40 random bits over the receiver's 16-bit index in its process:
# receivers sharing a UCX worker each probe for their own connections' CTRL messages.
RECEIVER_MASK = 0xFFFFFF
REPLY_MAX = 1 + 4 + 4096
# Messages one batch carries at most: their verdicts (5 bytes each, reasons aside) fit
# the reply buffer with room for the reasons of the refused.
MAX_BATCH = 64
# What one batch's inline tensors may take, all together.
INLINE_BATCH_MAX = CTRL_MAX - MAX_HEADER - 4
DEVICE_ACK = b"\x07"
_LEN = struct.Struct("!I")
_CONN = struct.Struct("!Q")
MAX_WORKER_ADDRESS = 1 << 16
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_SIOCGIFADDR = 0x8915


def _tag(conn: int, kind: int) -> int:
    return (conn << 8) | kind


def _interface_of(host: str) -> str | None:
    """The network interface that holds `host` (IPv4), e.g. lo for 127.0.0.1."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if ip.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                raw = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == str(ip):
            return name
    return None


def restrict_net_devices(host: str) -> None:
    """UCX's own transports listen on every network device unless told otherwise: a
    worker given one address uses only the device that holds it (unless UCX_NET_DEVICES
    is set, or a UCX worker already exists in this process)."""
    if host in _WILDCARDS or "UCX_NET_DEVICES" in os.environ or ucx_worker.active_workers():
        return
    device = _interface_of(host)
    if device is None:
        log.warning("no network device holds %s: UCX uses every device", host)
        return
    os.environ["UCX_NET_DEVICES"] = device


@dataclass
class _Peer:
    """The sender's side of one connection: its socket, endpoint, id and reply buffer."""

    sock: socket.socket
    endpoint: Any
    conn: int
    reply: Any = field(default_factory=lambda: np.empty(REPLY_MAX, dtype=np.uint8))
    alive: bool = True
    # Both ends take CUDA memory: device tensors go without a host bounce.
    device: bool = False
    # Made once per connection: each ucxx wrapper costs microseconds per message.
    reply_buffer: Any = None
    ctrl_tag: Any = None
    data_tag: Any = None
    reply_tag: Any = None
    # The KV blocks of the message in flight, gathered (reused: one message at a time).
    staging: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.reply_buffer = array(self.reply)
        self.ctrl_tag = UcxWorker.tag(_tag(self.conn, CTRL))
        self.data_tag = UcxWorker.tag(_tag(self.conn, DATA))
        self.reply_tag = UcxWorker.tag(_tag(self.conn, REPLY))

    def is_alive(self) -> bool:
        return self.alive

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self.alive = False
        with contextlib.suppress(Exception):
            loop.remove_reader(self.sock.fileno())
        self.sock.close()
        with contextlib.suppress(Exception):
            self.endpoint.close()


def gather_blocks(
    blocks: list[torch.Tensor], staging: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All KV blocks one after another in one flat uint8 tensor on their device: one copy,
    which costs less than a UCX rendezvous per block (bench/transfer.py). Copied into
    `staging` when it is large enough and on that device (a fresh buffer costs page
    faults that take longer than the copy). Returns (the buffer used, the blocks in it)."""
    nbytes = blocks[0].numel() * blocks[0].element_size()
    total = nbytes * len(blocks)
    device = blocks[0].device
    if staging is None or staging.numel() < total or staging.device != device:
        staging = torch.empty(total, dtype=torch.uint8, device=device)
    out = staging[:total]
    with torch.no_grad():
        torch.stack(
            [b.reshape(-1).view(torch.uint8) for b in blocks], out=out.view(len(blocks), nbytes)
        )
    return staging, out


def _finish_device_work(buffers: list[Any]) -> None:
    """UCX reads device memory on its own streams: the work that wrote each CUDA tensor
    (queued on its device's current stream) must be done before the sends are posted."""
    devices = {b.device for b in buffers if isinstance(b, torch.Tensor) and b.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


class UcxSender(Sender):
    """Keeps idle connections (socket + UCX endpoint) per address; concurrent sends open
    more, so one slow request never blocks another's hand-off."""

    max_batch = MAX_BATCH

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle: dict[str, list[_Peer]] = {}
        self._ucx: UcxWorker | None = None

    def _worker(self) -> UcxWorker:
        if self._ucx is None:
            self._ucx = ucx_worker.acquire()
        return self._ucx

    async def _connection(self, address: str) -> _Peer:
        idle = self._idle.get(address)
        while idle:
            peer = idle.pop()
            if peer.alive:
                return peer
        host, port = split_address(address, "ucx")
        loop = asyncio.get_running_loop()
        family, kind, proto, _, target = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        )[0]
        sock = socket.socket(family, kind, proto)
        _tune(sock)

        def read(n: int) -> Any:
            return _recv_bytes(loop, sock, n)

        try:
            await loop.sock_connect(sock, target)
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_SECONDS):
                await prove_peer(read, lambda b: loop.sock_sendall(sock, b), self._key, address)
                (size,) = _LEN.unpack(await read(_LEN.size))
                if size > MAX_WORKER_ADDRESS:
                    raise TransferRefused(f"{address} sent a worker address of {size} bytes")
                worker_address = await read(size)
                (conn,) = _CONN.unpack(await read(_CONN.size))
                ucx = self._worker()
                await loop.sock_sendall(sock, _LEN.pack(len(ucx.address)) + ucx.address)
                ready = await read(1)
                if ready not in (ACK, DEVICE_ACK):
                    raise TransferRefused(f"{address} did not take this worker's address")
            endpoint = ucx.endpoint(worker_address)
        except asyncio.IncompleteReadError as exc:
            sock.close()
            raise TransferRefused(f"{address} closed the connection in the handshake") from exc
        except BaseException:
            sock.close()
            raise
        peer = _Peer(sock, endpoint, conn, device=ready == DEVICE_ACK and ucx.device_memory)
        loop.add_reader(sock.fileno(), self._watch, loop, peer)
        return peer

    def _watch(self, loop: asyncio.AbstractEventLoop, peer: _Peer) -> None:
        """The receiver never writes on the socket after the handshake: readable means
        it closed (or died)."""
        with contextlib.suppress(OSError):
            if peer.sock.recv(1, socket.MSG_PEEK):
                return
        peer.alive = False
        loop.remove_reader(peer.sock.fileno())
        if self._ucx is not None:
            self._ucx.wake_sleepers()

    async def send(self, address: str, message: Message) -> None:
        loop = asyncio.get_running_loop()
        peer = await self._connection(address)
        header, buffers = frame_header(message, device_direct=peer.device, direct_min=DIRECT_MIN)
        inline, ctrl_size = [], 0
        for buf in buffers:
            here = (
                not isinstance(buf, torch.Tensor)
                and len(buf) <= INLINE_MAX
                and ctrl_size + len(buf) <= CTRL_MAX - MAX_HEADER - 4
            )
            inline.append(here)
            ctrl_size += len(buf) if here else 0
        header["inline"] = inline
        raw = encode_header(header)
        ctrl = bytearray(_LEN.pack(len(raw)) + raw)
        for buf, here in zip(buffers, inline, strict=True):
            if here:
                ctrl += buf
        large = [
            b if isinstance(b, torch.Tensor) else np.frombuffer(b, dtype=np.uint8)
            for b, h in zip(buffers, inline, strict=True)
            if not h
        ]
        started = time.perf_counter()
        ucx = self._worker()
        try:
            data = [*large]
            if message.blocks:
                peer.staging, blocks = gather_blocks(message.blocks, peer.staging)
                if blocks.is_cuda and not peer.device:
                    blocks = blocks.cpu()
                data.append(blocks if blocks.is_cuda else blocks.numpy())
            if peer.device:
                _finish_device_work(data)
            ctrl_buffer = array(np.frombuffer(ctrl, dtype=np.uint8))
            sends = [peer.endpoint.tag_send(ctrl_buffer, peer.ctrl_tag)]
            sends += [peer.endpoint.tag_send(array(b), peer.data_tag) for b in data]
            self.stats.on_frame()
            verdict = await self._exchange(ucx, peer, sends)
            if verdict == DROPPED:
                verdict = ACK
            if verdict == REFUSED:
                (size,) = _LEN.unpack(peer.reply[1 : 1 + _LEN.size].tobytes())
                reason = peer.reply[1 + _LEN.size : 1 + _LEN.size + size].tobytes()
                self._idle.setdefault(address, []).append(peer)
                raise TransferRefused(
                    f"{address} refused request {message.request_id}: "
                    + reason.decode(errors="replace")
                )
            if verdict != ACK:
                raise ConnectionError(f"{address} did not acknowledge")
        except TransferRefused:
            raise
        except BaseException:
            peer.close(loop)
            raise
        self._idle.setdefault(address, []).append(peer)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    def _batchable(self, message: Message) -> bool:
        return not message.blocks and all(
            t.numel() * t.element_size() <= INLINE_MAX for t in message.tensors.values()
        )

    async def _send_batch(self, address: str, messages: list[Message]) -> list[Verdict]:
        """One CTRL message: the batch header and every message's tensors inline (as
        host bytes). Those that would take it past CTRL_MAX are left BUSY (sent alone)."""
        verdicts = [Verdict(Outcome.BUSY, "over one batch's inline room")] * len(messages)
        headers: list[dict[str, object]] = []
        inline: list[Any] = []
        taken: list[int] = []
        room = INLINE_BATCH_MAX
        for i, message in enumerate(messages):
            header, buffers = frame_header(message)
            nbytes = sum(len(b) for b in buffers)
            if nbytes > room:
                continue
            room -= nbytes
            header["inline"] = [True] * len(buffers)
            headers.append(header)
            inline += buffers
            taken.append(i)
        if len(taken) < 2:
            return verdicts
        try:
            raw = encode_header({"batch": headers})
        except CodecError as exc:  # headers that fit alone but not together: each alone
            return [Verdict(Outcome.BUSY, str(exc))] * len(messages)
        ctrl = bytearray(_LEN.pack(len(raw)) + raw)
        for buf in inline:
            ctrl += buf
        loop = asyncio.get_running_loop()
        peer = await self._connection(address)
        started = time.perf_counter()
        try:
            ctrl_buffer = array(np.frombuffer(ctrl, dtype=np.uint8))
            sends = [peer.endpoint.tag_send(ctrl_buffer, peer.ctrl_tag)]
            self.stats.on_frame()
            kind = await self._exchange(self._worker(), peer, sends)
            if kind != batch.BATCHED:
                raise ConnectionError(f"{address} did not answer the batch ({kind!r})")
            (size,) = _LEN.unpack(peer.reply[1 : 1 + _LEN.size].tobytes())
            if size > REPLY_MAX - 1 - _LEN.size:
                raise ConnectionError(f"{address} sent a batch reply of {size} bytes")
            answer = peer.reply[1 + _LEN.size : 1 + _LEN.size + size].tobytes()
            replies = batch.read_verdicts(answer, len(taken))
        except BaseException:
            peer.close(loop)
            raise
        self._idle.setdefault(address, []).append(peer)
        seconds = time.perf_counter() - started
        for i, verdict in zip(taken, replies, strict=True):
            verdicts[i] = verdict
            if verdict.outcome is Outcome.ACK:
                self.stats.on_transfer(messages[i].nbytes, seconds)
        return verdicts

    @staticmethod
    async def _exchange(ucx: UcxWorker, peer: _Peer, sends: list[Any]) -> bytes:
        """Waits for the sends and the receiver's one-byte verdict that follows them."""
        reply = peer.endpoint.tag_recv(peer.reply_buffer, peer.reply_tag)
        try:
            await ucx.until(
                lambda: bool(reply.completed) and all(s.completed for s in sends), peer.is_alive
            )
        except PeerGone as exc:
            raise ConnectionError(f"the receiver went away mid-transfer: {exc}") from exc
        for request in (*sends, reply):
            request.check_error()
        return bytes(peer.reply[:1].tobytes())

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for peers in self._idle.values():
            for peer in peers:
                peer.close(loop)
        self._idle.clear()
        if self._ucx is not None:
            ucx_worker.release(self._ucx)
            self._ucx = None
