"""TCP backend: non-blocking sockets on the event loop. Frame = u32 header length,
msgpack header, buffers;
the receiver answers one ack byte once the message sits in the mailbox."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import numpy as np

from omnipipe.transfer.base import Message, Receiver, Sender, TransferStats, split_address
from omnipipe.transfer.codec import (
    MAX_HEADER,
    CodecError,
    decode_header,
    encode_header,
    rebuild,
    tensor_bytes,
    tensor_spec,
)

ACK = b"\x06"
# Large socket buffers: each event-loop wakeup moves more bytes, which is what limits an
# asyncio transfer of megabytes (the kernel caps them at net.core.[rw]mem_max).
SOCKET_BUFFER = 8 << 20


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


_LEN = struct.Struct("!I")


def frame_header(message: Message) -> tuple[dict[str, object], list[memoryview]]:
    specs, buffers = [], []
    for name, tensor in message.tensors.items():
        specs.append(tensor_spec(name, tensor))
        buffers.append(tensor_bytes(tensor))
    header = {
        "request_id": message.request_id,
        "source": message.source,
        "chunk": message.chunk,
        "final": message.final,
        "meta": message.meta,
        "tensors": specs,
    }
    return header, buffers


def message_from(header: dict[str, object], buffers: list[Any]) -> Message:
    specs = header["tensors"]
    assert isinstance(specs, list)
    tensors = {s["name"]: rebuild(s, b) for s, b in zip(specs, buffers, strict=True)}
    meta = header.get("meta") or {}
    return Message(
        request_id=str(header["request_id"]),
        source=str(header["source"]),
        tensors=tensors,
        chunk=int(header.get("chunk", 0)),  # type: ignore[call-overload]
        final=bool(header.get("final", True)),
        meta=dict(meta),  # type: ignore[call-overload]
    )


async def _recv_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))
        got += n


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> Any:
    """n bytes in a fresh numpy buffer: uninitialised memory, so the only pass over it is
    the kernel's copy (a bytearray would be zero-filled first)."""
    buf: Any = np.empty(n, dtype=np.uint8)
    if n:
        await _recv_into(loop, sock, memoryview(buf).cast("B"))
    return buf


class TcpReceiver(Receiver):
    """Raw non-blocking sockets: tensor bytes are received straight into the buffers the
    tensors are built on (no stream buffer, no intermediate copies)."""

    scheme = "tcp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sock = socket.create_server((self._host, self._port), reuse_port=False)
        self._sock.setblocking(False)
        self._port = self._sock.getsockname()[1]
        self._track(asyncio.create_task(self._accept()))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            _tune(conn)
            self._track(asyncio.create_task(self._serve(conn)))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    (size,) = _LEN.unpack((await _recv_exact(loop, conn, _LEN.size)).tobytes())
                except asyncio.IncompleteReadError:
                    return
                if size > MAX_HEADER:
                    raise CodecError(f"header of {size} bytes exceeds {MAX_HEADER}")
                started = time.perf_counter()
                header = decode_header((await _recv_exact(loop, conn, size)).tobytes())
                buffers = [
                    await _recv_exact(loop, conn, int(s["nbytes"])) for s in header["tensors"]
                ]
                message = message_from(header, buffers)
                await self.mailbox.put(message)
                self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
                await loop.sock_sendall(conn, ACK)
        except (CodecError, ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            conn.close()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class TcpSender(Sender):
    """Keeps idle connections per address; concurrent sends open more, so one slow
    request never blocks another's hand-off. Buffers go out with sock_sendall, which
    sends from the tensor's memory without copying it."""

    def __init__(self, stats: TransferStats | None = None) -> None:
        super().__init__(stats)
        self._idle: dict[str, list[socket.socket]] = {}

    async def _connection(self, address: str) -> socket.socket:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
        host, port = split_address(address, "tcp")
        loop = asyncio.get_running_loop()
        family, kind, proto, _, target = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        )[0]
        sock = socket.socket(family, kind, proto)
        _tune(sock)
        try:
            await loop.sock_connect(sock, target)
        except BaseException:
            sock.close()
            raise
        return sock

    async def send(self, address: str, message: Message) -> None:
        header, buffers = frame_header(message)
        raw = encode_header(header)
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        sock = await self._connection(address)
        try:
            await loop.sock_sendall(sock, _LEN.pack(len(raw)) + raw)
            for buf in buffers:
                if len(buf):
                    await loop.sock_sendall(sock, buf)
            ack = await loop.sock_recv(sock, 1)
            if ack != ACK:
                raise ConnectionError(f"{address} did not acknowledge")
        except BaseException:
            sock.close()
            raise
        self._idle.setdefault(address, []).append(sock)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    async def close(self) -> None:
        for socks in self._idle.values():
            for sock in socks:
                sock.close()
        self._idle.clear()
