"""TCP backend: non-blocking sockets on the event loop. A connection opens with the
credential handshake (transfer/auth.py); then each frame = u32 header length, msgpack
header, buffers. The receiver answers one ack byte once the message sits in the mailbox,
or REFUSED, u32 length and a reason (the mailbox is full): the sender raises it. A batch
frame carries several messages, with one verdict each (transfer/batch.py)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any

import numpy as np

from omnipipe.transfer import batch
from omnipipe.transfer.auth import (
    HANDSHAKE_TIMEOUT_SECONDS,
    REFUSED,
    TransferRefused,
    accept_peer,
    prove_peer,
)
from omnipipe.transfer.base import (
    ACCEPTED,
    BlockTableFull,
    Outcome,
    Receiver,
    Sender,
    TransferStats,
    Verdict,
    split_address,
)
from omnipipe.transfer.codec import (
    MAX_HEADER,
    CodecError,
    decode_frame_header,
    encode_header,
    tensor_bytes,
)
from omnipipe.transfer.frames import (
    block_buffers,
    block_bytes,
    declared_bytes,
    frame_header,
    message_from,
)
from omnipipe.transfer.mailbox import Charge, MailboxFull
from omnipipe.transfer.message import Message, stamp_received

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


def refusal(reason: str) -> bytes:
    raw = reason.encode()[:4096]
    return REFUSED + _LEN.pack(len(raw)) + raw


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


async def _recv_bytes(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    return bytes((await _recv_exact(loop, sock, n)).tobytes())


async def _write_frame(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    raw: bytes,
    buffers: Iterable[Any],
) -> None:
    """One frame: the length-prefixed header, then its buffers (empty ones skipped)."""
    await loop.sock_sendall(sock, _LEN.pack(len(raw)) + raw)
    for buf in buffers:
        if len(buf):
            await loop.sock_sendall(sock, buf)


async def _drain(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> None:
    """Read and drop n bytes through a small scratch buffer: a refused message's tensors
    are never held."""
    array: Any = np.empty(min(n, 1 << 20), dtype=np.uint8)
    scratch = memoryview(array).cast("B")
    while n > 0:
        step = min(n, len(scratch))
        await _recv_into(loop, sock, scratch[:step])
        n -= step


class ListeningReceiver(Receiver):
    """A TCP socket bound to exactly the host given (127.0.0.1 listens on loopback only).
    Each connection opens with the credential handshake, then carries framed messages,
    one after another, until the sender closes it. The backends differ in what follows
    the handshake (`_opened`) and in how one message's tensors arrive (`_receive_one`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sock = socket.create_server((self._host, self._port), reuse_port=False)
        self._sock.setblocking(False)
        self.bound = self._sock.getsockname()[:2]
        self._port = self.bound[1]
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
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_SECONDS):
                    if not await accept_peer(
                        lambda n: _recv_bytes(loop, conn, n),
                        lambda b: loop.sock_sendall(conn, b),
                        self._key,
                    ):
                        return
            except TimeoutError:
                return
            context = await self._opened(loop, conn)
            while True:
                try:
                    (size,) = _LEN.unpack(await _recv_bytes(loop, conn, _LEN.size))
                except asyncio.IncompleteReadError:
                    return
                await self._receive_one(loop, conn, size, context)
        except Exception as exc:
            # A peer that went away or sent garbage ends only its own connection.
            if not isinstance(exc, self._peer_errors()):
                raise
        finally:
            conn.close()

    async def _opened(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> Any:
        """What the connection needs after the handshake; handed to each _receive_one."""
        return None

    def _peer_errors(self) -> tuple[type[BaseException], ...]:
        return (CodecError, ConnectionError, asyncio.IncompleteReadError)

    @abstractmethod
    async def _receive_one(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, context: Any
    ) -> None: ...

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class TcpReceiver(ListeningReceiver):
    """Raw non-blocking sockets: tensor bytes are received straight into the buffers the
    tensors are built on (no stream buffer, no intermediate copies)."""

    scheme = "tcp"

    async def _receive_one(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, context: Any
    ) -> None:
        if size > MAX_HEADER:
            raise CodecError(f"header of {size} bytes exceeds {MAX_HEADER}")
        started = time.perf_counter()
        header = decode_frame_header(await _recv_bytes(loop, conn, size))
        self.stats.on_frame()
        if batch.is_batch(header):
            await self._receive_batch(loop, conn, header["batch"], size, started)
            return
        nbytes = declared_bytes(header)
        in_blocks = block_bytes(header)
        try:
            charge = self.mailbox.reserve(str(header.get("request_id")), nbytes + size)
        except MailboxFull as exc:
            await _drain(loop, conn, nbytes + in_blocks)
            await loop.sock_sendall(conn, refusal(str(exc)))
            return
        if charge is None:  # the request already ended here: a late chunk
            await _drain(loop, conn, nbytes + in_blocks)
            await loop.sock_sendall(conn, ACK)
            return
        try:
            ids = self._allocate_blocks(header)
        except BlockTableFull as exc:
            self.mailbox.release(charge)
            await _drain(loop, conn, nbytes + in_blocks)
            await loop.sock_sendall(conn, refusal(str(exc)))
            return
        try:
            buffers = [await _recv_exact(loop, conn, int(s["nbytes"])) for s in header["tensors"]]
            rows = self.block_table.rows(ids) if self.block_table is not None else []
            for row in rows:
                await _recv_into(loop, conn, tensor_bytes(row))
            message = self._owning_rows(message_from(header, buffers, ids, rows))
        except BaseException:
            self.mailbox.release(charge)
            if ids and self.block_table is not None:
                self.block_table.free(ids)
            raise
        seconds = stamp_received(message, started)
        await self.mailbox.put(message, charge)
        self.stats.on_transfer(message.nbytes, seconds)
        await loop.sock_sendall(conn, ACK)

    async def _receive_batch(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        subs: list[dict[str, Any]],
        size: int,
        started: float,
    ) -> None:
        """Each message of a batch taken or answered on its own, none waiting for room:
        all are received, then queued, then the verdicts go back in one reply."""
        sizes = [declared_bytes(sub) for sub in subs]
        if any(block_bytes(sub) for sub in subs):
            raise CodecError("KV blocks travel alone, not in a batch")
        verdicts: list[Verdict] = []
        received: list[tuple[Message, Charge] | None] = []
        charges: list[Charge] = []  # released if the batch is cut short
        try:
            for sub, nbytes in zip(subs, sizes, strict=True):
                room = batch.admit(
                    self.mailbox, str(sub.get("request_id")), nbytes + size // len(subs)
                )
                if not isinstance(room, Charge):
                    await _drain(loop, conn, nbytes)
                    verdicts.append(ACCEPTED if room is None else room)
                    received.append(None)
                    continue
                charges.append(room)
                buffers = [await _recv_exact(loop, conn, int(s["nbytes"])) for s in sub["tensors"]]
                received.append((message_from(sub, buffers), room))
                verdicts.append(ACCEPTED)
        except BaseException:
            for charge in charges:
                self.mailbox.release(charge)
            raise
        for i, item in enumerate(received):
            if item is not None:
                message, charge = item
                seconds = stamp_received(message, started)
                verdicts[i] = batch.deliver(self.mailbox, message, charge)
                self.stats.on_transfer(message.nbytes, seconds)
        await loop.sock_sendall(conn, batch.batch_reply(verdicts))


class TcpSender(Sender):
    """Keeps idle connections per address; concurrent sends open more, so one slow
    request never blocks another's hand-off. Buffers go out with sock_sendall, which
    sends from the tensor's memory without copying it."""

    def __init__(self, stats: TransferStats | None = None, credential: str | None = None) -> None:
        super().__init__(stats, credential)
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
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_SECONDS):
                await prove_peer(
                    lambda n: _recv_bytes(loop, sock, n),
                    lambda b: loop.sock_sendall(sock, b),
                    self._key,
                    address,
                )
        except asyncio.IncompleteReadError as exc:
            sock.close()
            raise TransferRefused(f"{address} closed the connection in the handshake") from exc
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
            await _write_frame(loop, sock, raw, [*buffers, *block_buffers(message)])
            self.stats.on_frame()
            ack = await loop.sock_recv(sock, 1)
            if ack == REFUSED:
                (size,) = _LEN.unpack(await _recv_bytes(loop, sock, _LEN.size))
                reason = (await _recv_bytes(loop, sock, size)).decode(errors="replace")
                self._idle.setdefault(address, []).append(sock)
                raise TransferRefused(f"{address} refused request {message.request_id}: {reason}")
            if ack != ACK:
                raise ConnectionError(f"{address} did not acknowledge")
        except TransferRefused:
            raise
        except BaseException:
            sock.close()
            raise
        self._idle.setdefault(address, []).append(sock)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    def _batchable(self, message: Message) -> bool:
        return not message.blocks

    async def _send_batch(self, address: str, messages: list[Message]) -> list[Verdict]:
        parts = [frame_header(m) for m in messages]
        try:
            raw = encode_header({"batch": [header for header, _ in parts]})
        except CodecError as exc:  # headers that fit alone but not together: each alone
            return [Verdict(Outcome.BUSY, str(exc))] * len(messages)
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        sock = await self._connection(address)
        try:
            await _write_frame(loop, sock, raw, [buf for _, buffers in parts for buf in buffers])
            self.stats.on_frame()
            kind = await loop.sock_recv(sock, 1)
            if kind != batch.BATCHED:
                raise ConnectionError(f"{address} did not answer the batch ({kind!r})")
            (size,) = _LEN.unpack(await _recv_bytes(loop, sock, _LEN.size))
            verdicts = batch.read_verdicts(await _recv_bytes(loop, sock, size), len(messages))
        except asyncio.IncompleteReadError as exc:
            sock.close()
            raise ConnectionError(f"{address} closed the connection mid-reply") from exc
        except BaseException:
            sock.close()
            raise
        self._idle.setdefault(address, []).append(sock)
        seconds = time.perf_counter() - started
        for message, verdict in zip(messages, verdicts, strict=True):
            if verdict.outcome is Outcome.ACK:
                self.stats.on_transfer(message.nbytes, seconds)
        return verdicts

    async def close(self) -> None:
        for socks in self._idle.values():
            for sock in socks:
                sock.close()
        self._idle.clear()
