"""TCP backend: asyncio streams. Frame = u32 header length, msgpack header, buffers;
the receiver answers one ack byte once the message sits in the mailbox."""

from __future__ import annotations

import asyncio
import struct
import time
from contextlib import suppress

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


def message_from(header: dict[str, object], buffers: list[bytearray]) -> Message:
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


class TcpReceiver(Receiver):
    scheme = "tcp"
    _server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=1 << 20
        )
        self._port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                except asyncio.IncompleteReadError:
                    return
                if size > MAX_HEADER:
                    raise CodecError(f"header of {size} bytes exceeds {MAX_HEADER}")
                started = time.perf_counter()
                header = decode_header(await reader.readexactly(size))
                buffers = [
                    bytearray(await reader.readexactly(int(s["nbytes"]))) for s in header["tensors"]
                ]
                message = message_from(header, buffers)
                await self.mailbox.put(message)
                self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
                writer.write(ACK)
                await writer.drain()
        except (CodecError, ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class TcpSender(Sender):
    """Keeps idle connections per address; concurrent sends open more, so one slow
    request never blocks another's hand-off."""

    def __init__(self, stats: TransferStats | None = None) -> None:
        super().__init__(stats)
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def _connection(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
        host, port = split_address(address, "tcp")
        return await asyncio.open_connection(host, port)

    async def send(self, address: str, message: Message) -> None:
        header, buffers = frame_header(message)
        raw = encode_header(header)
        started = time.perf_counter()
        reader, writer = await self._connection(address)
        try:
            writer.write(_LEN.pack(len(raw)))
            writer.write(raw)
            for buf in buffers:
                writer.write(buf)
                await writer.drain()
            await writer.drain()
            if await reader.readexactly(1) != ACK:
                raise ConnectionError(f"{address} did not acknowledge")
        except BaseException:
            writer.close()
            raise
        self._idle.setdefault(address, []).append((reader, writer))
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()
