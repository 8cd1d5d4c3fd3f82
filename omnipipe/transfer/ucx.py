"""UCX backend (ucxx): tensors travel as UCX tagged messages over persistent endpoints,
which pick shared memory, CMA, TCP or RDMA as the hardware allows. Imported only when
selected.

ucxx's sockaddr listener takes a port only and listens on every interface, so it is not
used. Instead a TCP socket bound to exactly the given host is the rendezvous: a sender
connects, both ends prove the pipeline credential (transfer/auth.py), and the receiver
answers its UCX worker address and a random 64-bit tag for this connection; the sender
opens a UCX endpoint from that address. Each message then goes: frame (u32 header length,
msgpack header, tensors up to INLINE_MAX) over the socket; the receiver reserves room in
its mailbox and answers GO (larger tensors follow as tagged UCX messages, each received
straight into the buffer its tensor is built on), ACK, or REFUSED with a reason. No UCX
receive is posted while idle, so an idle worker burns no CPU."""

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnipipe.transfer.auth import (
    HANDSHAKE_TIMEOUT_SECONDS,
    REFUSED,
    TransferRefused,
    prove_peer,
)
from omnipipe.transfer.base import MailboxFull, Message, Sender, split_address
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_header, encode_header
from omnipipe.transfer.tcp import (
    ACK,
    ListeningReceiver,
    _drain,
    _recv_bytes,
    _recv_exact,
    _tune,
    declared_bytes,
    frame_header,
    message_from,
    refusal,
)

log = logging.getLogger(__name__)

# Small tensors travel inside the frame (one socket write carries a whole small hand-off);
# larger ones follow as their own UCX messages, sent from their memory.
INLINE_MAX = 64 * 1024
GO = b"\x11"
_LEN = struct.Struct("!I")
_TAG = struct.Struct("!Q")
MAX_WORKER_ADDRESS = 1 << 16
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
_SIOCGIFADDR = 0x8915

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Without it ucxx awaits a request by polling it from the event loop, so a pending
# receive burns a core; with it a notifier thread completes Python futures.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")


def _ucxx() -> Any:
    import ucxx

    return ucxx


class _Context:
    """ucxx's context (and its notifier thread) belongs to the event loop that made it and
    keeps the process alive until stopped: reset it when the last user closes, so that
    process exit never hangs and a later event loop starts afresh."""

    users = 0

    @classmethod
    def acquire(cls) -> Any:
        cls.users += 1
        return _ucxx()

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0:
            with contextlib.suppress(Exception):
                _ucxx().reset()


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
    is set, or a UCX context already exists in this process)."""
    if host in _WILDCARDS or "UCX_NET_DEVICES" in os.environ or _Context.users:
        return
    device = _interface_of(host)
    if device is None:
        log.warning("no network device holds %s: UCX uses every device", host)
        return
    os.environ["UCX_NET_DEVICES"] = device


def _closed_errors() -> tuple[type[BaseException], ...]:
    errors = _ucxx().exceptions
    return (errors.UCXError, errors.UCXCanceled, ConnectionError)


class UcxReceiver(ListeningReceiver):
    scheme = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._worker_address = b""
        self._acquired = False

    async def start(self) -> None:
        restrict_net_devices(self._host)
        ucxx = _Context.acquire()
        self._acquired = True
        ucxx.continuous_ucx_progress()
        self._worker_address = bytes(ucxx.get_worker_address())
        await super().start()

    async def _opened(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> int:
        """Hands the sender this worker's UCX address and the connection's message tag."""
        tag = secrets.randbits(64)
        await loop.sock_sendall(
            conn, _LEN.pack(len(self._worker_address)) + self._worker_address + _TAG.pack(tag)
        )
        return tag

    def _peer_errors(self) -> tuple[type[BaseException], ...]:
        return (*_closed_errors(), CodecError, asyncio.IncompleteReadError)

    async def _receive_one(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, tag: Any
    ) -> None:
        if size > MAX_HEADER:
            raise CodecError(f"header of {size} bytes exceeds {MAX_HEADER}")
        started = time.perf_counter()
        header = decode_header(await _recv_bytes(loop, conn, size))
        nbytes = declared_bytes(header)
        sizes = [int(spec["nbytes"]) for spec in header["tensors"]]
        inline = sum(n for n in sizes if n <= INLINE_MAX)
        try:
            charge = self.mailbox.reserve(str(header.get("request_id")), nbytes + size)
        except MailboxFull as exc:
            await _drain(loop, conn, inline)
            await loop.sock_sendall(conn, refusal(str(exc)))
            return
        if charge is None:  # the request already ended here: a late chunk, dropped
            await _drain(loop, conn, inline)
            await loop.sock_sendall(conn, ACK)
            return
        try:
            buffers: list[Any] = [
                await _recv_exact(loop, conn, n) if n <= INLINE_MAX else None for n in sizes
            ]
            if inline < nbytes:
                await loop.sock_sendall(conn, GO)
                ucxx = _ucxx()
                for i, n in enumerate(sizes):
                    if buffers[i] is None:
                        buffers[i] = np.empty(n, dtype=np.uint8)
                        await ucxx.recv(buffers[i], tag)
            message = message_from(header, buffers)
        except BaseException:
            self.mailbox.release(charge)
            raise
        await self.mailbox.put(message, charge)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
        await loop.sock_sendall(conn, ACK)

    async def close(self) -> None:
        await super().close()
        if self._acquired:
            self._acquired = False
            _Context.release()


@dataclass
class _Peer:
    sock: socket.socket
    endpoint: Any
    tag: int

    async def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(Exception):
            await self.endpoint.close()


class UcxSender(Sender):
    """Keeps idle connections (socket + UCX endpoint) per address; concurrent sends open
    more, so one slow request never blocks another's hand-off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle: dict[str, list[_Peer]] = {}
        self._acquired = False

    async def _connection(self, address: str) -> _Peer:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
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
                (tag,) = _TAG.unpack(await read(_TAG.size))
            if not self._acquired:
                _Context.acquire()
                self._acquired = True
            ucxx = _ucxx()
            endpoint = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(worker_address)
            )
        except asyncio.IncompleteReadError as exc:
            sock.close()
            raise TransferRefused(f"{address} closed the connection in the handshake") from exc
        except BaseException:
            sock.close()
            raise
        return _Peer(sock, endpoint, tag)

    async def send(self, address: str, message: Message) -> None:
        header, buffers = frame_header(message)
        raw = encode_header(header)
        inline = [b for b in buffers if len(b) <= INLINE_MAX]
        large = [b for b in buffers if len(b) > INLINE_MAX]
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        peer = await self._connection(address)
        try:
            await loop.sock_sendall(peer.sock, b"".join([_LEN.pack(len(raw)), raw, *inline]))
            verdict = await _recv_bytes(loop, peer.sock, 1)
            if verdict == GO:
                for buf in large:
                    await peer.endpoint.send(
                        np.frombuffer(buf, dtype=np.uint8), tag=peer.tag, force_tag=True
                    )
                verdict = await _recv_bytes(loop, peer.sock, 1)
            if verdict == REFUSED:
                (size,) = _LEN.unpack(await _recv_bytes(loop, peer.sock, _LEN.size))
                reason = (await _recv_bytes(loop, peer.sock, size)).decode(errors="replace")
                self._idle.setdefault(address, []).append(peer)
                raise TransferRefused(f"{address} refused request {message.request_id}: {reason}")
            if verdict != ACK:
                raise ConnectionError(f"{address} did not acknowledge")
        except TransferRefused:
            raise
        except BaseException:
            await peer.close()
            raise
        self._idle.setdefault(address, []).append(peer)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    async def close(self) -> None:
        for peers in self._idle.values():
            for peer in peers:
                await peer.close()
        self._idle.clear()
        if self._acquired:
            self._acquired = False
            _Context.release()
