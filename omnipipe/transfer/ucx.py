"""UCX backend: tensors travel as UCX tagged messages between two processes' UCX workers
(transfer/ucx_worker.py), which pick CMA, shared memory, TCP or RDMA as the hardware
allows. Imported only when selected.

ucxx's sockaddr listener takes a port only and listens on every interface, and UCX
endpoints made through it are restricted to TCP, so it is not used. Instead a TCP socket
bound to exactly the given host is the rendezvous: a sender connects, both ends prove the
pipeline credential (transfer/auth.py), then exchange UCX worker addresses; the receiver
also names a random 56-bit connection id. The socket then carries nothing: it stays open
so that either end sees the other die (the UCX endpoints run without error handling).

Tags are the connection id (see RECEIVER_MASK) shifted left 8 bits plus a kind. One message goes:
    sender -> CTRL: u32 header length, msgpack header, the tensors that fit inline
    receiver reserves room in its mailbox, then
    receiver -> REPLY: ACK (all inline), REFUSED u32 reason, or GO once it has posted a
        receive for each large tensor straight into the buffer its tensor is built on
    sender -> DATA: each large tensor, from its own memory; receiver -> REPLY: ACK
Nothing is set up per message: endpoints live as long as the connection, the reply buffer
is the connection's, and large receive buffers come from a pool."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnipipe.transfer import ucx_worker
from omnipipe.transfer.auth import HANDSHAKE_TIMEOUT_SECONDS, REFUSED, TransferRefused, prove_peer
from omnipipe.transfer.base import BlockTableFull, MailboxFull, Message, Sender, split_address
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_header, encode_header
from omnipipe.transfer.tcp import (
    ACK,
    ListeningReceiver,
    _recv_bytes,
    _tune,
    block_buffers,
    declared_bytes,
    frame_header,
    message_from,
)
from omnipipe.transfer.ucx_worker import PeerGone, UcxWorker, array

log = logging.getLogger(__name__)

# Tensors up to this size ride in the CTRL message, while it stays under CTRL_MAX.
INLINE_MAX = 64 * 1024
CTRL_MAX = MAX_HEADER + 4 + 4 * INLINE_MAX
GO = b"\x11"
# The request already ended here: the sender keeps its large tensors (nothing to move).
DROPPED = b"\x12"
CTRL, DATA, REPLY = 1, 2, 3
# A connection id is 40 random bits over the receiver's 16-bit index in its process:
# receivers sharing a UCX worker each probe for their own connections' CTRL messages.
RECEIVER_MASK = 0xFFFFFF
REPLY_MAX = 1 + 4 + 4096
DEVICE_ACK = b"\x07"
_LEN = struct.Struct("!I")
_CONN = struct.Struct("!Q")
MAX_WORKER_ADDRESS = 1 << 16
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_SIOCGIFADDR = 0x8915
_ACK = np.frombuffer(bytearray(ACK), dtype=np.uint8)
_GO = np.frombuffer(bytearray(GO), dtype=np.uint8)
_DROPPED = np.frombuffer(bytearray(DROPPED), dtype=np.uint8)


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


def _refusal(reason: str) -> Any:
    raw = reason.encode()[:4096]
    return np.frombuffer(bytearray(REFUSED + _LEN.pack(len(raw)) + raw), dtype=np.uint8)


@dataclass
class _Connection:
    """The receiver's side of one sender connection."""

    conn: int
    endpoint: Any
    alive: bool = True
    # Replies in flight: their buffers live until UCX is done with them.
    pending: list[tuple[Any, Any]] = field(default_factory=list)

    def is_alive(self) -> bool:
        return self.alive

    def reply(self, payload: Any) -> None:
        self.pending = [(r, b) for r, b in self.pending if not r.completed]
        request = self.endpoint.tag_send(
            array(payload), ucx_worker.UcxWorker.tag(_tag(self.conn, REPLY))
        )
        self.pending.append((request, payload))


class UcxReceiver(ListeningReceiver):
    scheme = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ucx: UcxWorker | None = None
        self._conns: dict[int, _Connection] = {}
        self._index = 0

    async def start(self) -> None:
        restrict_net_devices(self._host)
        self._ucx = ucx_worker.acquire()
        self._index = self._ucx.next_receiver_index()
        await super().start()
        self._track(asyncio.create_task(self._dispatch()))

    async def _opened(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Exchanges worker addresses, then holds the connection until the sender closes
        its socket (or dies): that ends the UCX side too."""
        ucx = self._ucx
        assert ucx is not None
        conn_id = (secrets.randbits(40) << 16) | self._index
        address = ucx.address
        await loop.sock_sendall(conn, _LEN.pack(len(address)) + address + _CONN.pack(conn_id))
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_SECONDS):
            (size,) = _LEN.unpack(await _recv_bytes(loop, conn, _LEN.size))
            if size > MAX_WORKER_ADDRESS:
                raise CodecError(f"a worker address of {size} bytes")
            peer_address = await _recv_bytes(loop, conn, size)
        state = _Connection(conn_id, ucx.endpoint(peer_address))
        self._conns[conn_id] = state
        try:
            # Registered: messages may come. DEVICE_ACK: CUDA tensors may come from
            # device memory and are received into device memory here.
            await loop.sock_sendall(conn, DEVICE_ACK if ucx.device_memory else ACK)
            while await loop.sock_recv(conn, 1):
                pass  # nothing travels here after the handshake
        except OSError:
            pass
        finally:
            state.alive = False
            self._conns.pop(conn_id, None)
            ucx.wake_sleepers()
            with contextlib.suppress(Exception):
                state.endpoint.close()

    async def _receive_one(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, context: Any
    ) -> None:
        raise CodecError("frames travel over UCX, not the rendezvous socket")

    def _peer_errors(self) -> tuple[type[BaseException], ...]:
        return (CodecError, ConnectionError, asyncio.IncompleteReadError)

    async def _dispatch(self) -> None:
        """Takes each CTRL message, whichever connection sent it."""
        ucx = self._ucx
        assert ucx is not None
        probed: Any = None

        def arrived() -> bool:
            nonlocal probed
            if probed is None:
                probed = ucx.probe(_tag(self._index, CTRL), RECEIVER_MASK)
            return probed is not None

        while True:
            probed = None
            await ucx.until(arrived, lambda: True)
            state = self._conns.get(int(probed.sender_tag.value) >> 8)
            if probed.length > CTRL_MAX:
                # Only an authenticated peer knows the tag: drop its connection.
                log.warning("dropping a %d-byte control message", probed.length)
                if state is not None:
                    state.alive = False
                    ucx.wake_sleepers()
                continue
            buf = np.empty(probed.length, dtype=np.uint8)
            request = ucx.recv_probed(buf, probed)
            if state is None:
                continue  # a connection that closed: received and dropped
            if not (request.completed and self._try_now(state, buf, request)):
                self._track(asyncio.create_task(self._handle(state, buf, request)))

    def _header(self, buf: Any) -> tuple[dict[str, Any], int]:
        if len(buf) < _LEN.size:
            raise CodecError("short control message")
        (size,) = _LEN.unpack(buf[: _LEN.size].tobytes())
        if size > MAX_HEADER or _LEN.size + size > len(buf):
            raise CodecError(f"header of {size} bytes in a {len(buf)}-byte message")
        return decode_header(buf[_LEN.size : _LEN.size + size].tobytes()), _LEN.size + size

    def _inline_buffers(
        self, header: dict[str, Any], buf: Any, offset: int
    ) -> tuple[list[Any], list[int]]:
        """Views of the inline tensors in the control buffer, None for each large one,
        and the large ones' sizes."""
        inline = header.get("inline")
        specs = header["tensors"]
        if not isinstance(inline, list) or len(inline) != len(specs):
            raise CodecError("control message without its inline list")
        buffers: list[Any] = []
        large: list[int] = []
        for spec, here in zip(specs, inline, strict=True):
            n = int(spec["nbytes"])
            if here:
                if offset + n > len(buf):
                    raise CodecError("control message shorter than its inline tensors")
                buffers.append(buf[offset : offset + n])
                offset += n
            else:
                buffers.append(None)
                large.append(n)
        return buffers, large

    def _try_now(self, state: _Connection, buf: Any, request: Any) -> bool:
        """The common small hand-off without leaving the dispatcher: all inline, and the
        request's queue has room. False: leave it to _handle."""
        try:
            request.check_error()
            header, offset = self._header(buf)
            buffers, large = self._inline_buffers(header, buf, offset)
        except Exception:
            return False
        request_id = str(header.get("request_id"))
        if large or header.get("blocks") or not self.mailbox.has_room_now(request_id):
            return False
        started = time.perf_counter()
        try:
            charge = self.mailbox.reserve(request_id, declared_bytes(header) + offset)
        except MailboxFull as exc:
            state.reply(_refusal(str(exc)))
            return True
        except CodecError:
            return False
        if charge is None:
            state.reply(_ACK)
            return True
        try:
            message = message_from(header, buffers)
        except Exception:
            self.mailbox.release(charge)
            return False
        self.mailbox.put_nowait(message, charge)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
        state.reply(_ACK)
        return True

    def _receive_buffer(self, spec: dict[str, Any]) -> Any:
        """Device memory for a tensor sent from it, when this worker takes it (untested
        here: no GPU); else a pooled host buffer."""
        ucx = self._ucx
        assert ucx is not None
        nbytes = int(spec["nbytes"])
        if spec.get("direct") and ucx.device_memory:
            return torch.empty(nbytes, dtype=torch.uint8, device=str(spec["device"]))
        return ucx.pool.take(nbytes)

    async def _handle(self, state: _Connection, buf: Any, request: Any) -> None:
        ucx = self._ucx
        assert ucx is not None
        charge = None
        ids: list[int] = []
        posted: list[Any] = []
        try:
            await ucx.until(lambda: bool(request.completed), state.is_alive)
            request.check_error()
            started = time.perf_counter()
            header, offset = self._header(buf)
            buffers, large = self._inline_buffers(header, buf, offset)
            try:
                charge = self.mailbox.reserve(
                    str(header.get("request_id")), declared_bytes(header) + offset
                )
            except MailboxFull as exc:
                state.reply(_refusal(str(exc)))
                return
            if charge is None:  # the request already ended here: a late chunk, dropped
                state.reply(_DROPPED)
                return
            try:
                ids = self._allocate_blocks(header)
            except BlockTableFull as exc:
                state.reply(_refusal(str(exc)))
                return
            rows = self.block_table.rows(ids) if self.block_table is not None else []
            if large or rows:
                # Receives go in the order the sender sends: tensors, then blocks, each
                # straight into the memory it ends up in.
                data_tag = UcxWorker.tag(_tag(state.conn, DATA))
                for i, b in enumerate(buffers):
                    if b is None:
                        buffers[i] = self._receive_buffer(header["tensors"][i])
                        posted.append(state.endpoint.tag_recv(array(buffers[i]), data_tag))
                for row in rows:
                    posted.append(state.endpoint.tag_recv(array(row.numpy()), data_tag))
                state.reply(_GO)
                await ucx.until(lambda: all(r.completed for r in posted), state.is_alive)
                for r in posted:
                    r.check_error()
            message = message_from(header, buffers, ids, rows)
            await self.mailbox.put(message, charge)
            charge, ids = None, []
            self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
            state.reply(_ACK)
        except (CodecError, ConnectionError) as exc:
            log.warning("transfer connection %x: %s", state.conn, exc)
            state.alive = False
            ucx.wake_sleepers()
        except Exception as exc:
            if not isinstance(exc, ucx_worker.ucx_errors()):
                raise
            log.warning("transfer connection %x: %s", state.conn, exc)
        finally:
            if charge is not None:
                self.mailbox.release(charge)
            # A receive still posted may yet write into its rows: they stay out of use.
            if ids and self.block_table is not None and all(r.completed for r in posted):
                self.block_table.free(ids)

    async def close(self) -> None:
        await super().close()
        if self._ucx is not None:
            for state in self._conns.values():
                state.alive = False
            ucx_worker.release(self._ucx)
            self._ucx = None


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

    def is_alive(self) -> bool:
        return self.alive

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self.alive = False
        with contextlib.suppress(Exception):
            loop.remove_reader(self.sock.fileno())
        self.sock.close()
        with contextlib.suppress(Exception):
            self.endpoint.close()


class UcxSender(Sender):
    """Keeps idle connections (socket + UCX endpoint) per address; concurrent sends open
    more, so one slow request never blocks another's hand-off."""

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
        header, buffers = frame_header(message, device_direct=peer.device)
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
        reply_tag = UcxWorker.tag(_tag(peer.conn, REPLY))
        try:
            verdict = await self._exchange(
                ucx,
                peer,
                [
                    peer.endpoint.tag_send(
                        array(np.frombuffer(ctrl, dtype=np.uint8)),
                        UcxWorker.tag(_tag(peer.conn, CTRL)),
                    )
                ],
                reply_tag,
            )
            if verdict == GO:
                data_tag = UcxWorker.tag(_tag(peer.conn, DATA))
                blocks = [np.frombuffer(b, dtype=np.uint8) for b in block_buffers(message)]
                verdict = await self._exchange(
                    ucx,
                    peer,
                    [peer.endpoint.tag_send(array(b), data_tag) for b in [*large, *blocks]],
                    reply_tag,
                )
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

    @staticmethod
    async def _exchange(ucx: UcxWorker, peer: _Peer, sends: list[Any], reply_tag: Any) -> bytes:
        """Waits for the sends and the receiver's one-byte verdict that follows them."""
        reply = peer.endpoint.tag_recv(array(peer.reply), reply_tag)
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
