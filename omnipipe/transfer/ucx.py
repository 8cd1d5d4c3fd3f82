"""UCX backend (ucxx): the same frames as TCP, carried over UCX endpoints, which pick
shared memory, CMA, TCP or RDMA as the hardware allows. Imported only when selected."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import numpy as np

from omnipipe.transfer.base import Message, Receiver, Sender, split_address
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_header, encode_header
from omnipipe.transfer.tcp import frame_header, message_from

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _ucxx() -> Any:
    import ucxx

    return ucxx


def _closed_errors() -> tuple[type[BaseException], ...]:
    errors = _ucxx().exceptions
    return (errors.UCXError, errors.UCXCanceled, ConnectionError)


class UcxReceiver(Receiver):
    scheme = "ucx"
    _listener: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._listener = _ucxx().create_listener(self._serve, self._port)
        self._port = self._listener.port

    async def _serve(self, ep: Any) -> None:
        # One message per endpoint: a receive left pending on an idle endpoint makes ucxx
        # spin a core (its request wait polls), so nothing waits between messages.
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._receive_one(ep)
        except Exception as exc:
            # A peer that went away or sent garbage ends only its own connection.
            if not isinstance(exc, (*_closed_errors(), CodecError)):
                raise
        finally:
            if task is not None:
                self._handlers.discard(task)
            with contextlib.suppress(Exception):
                await ep.close()

    async def _receive_one(self, ep: Any) -> None:
        size = np.empty(1, dtype=np.uint64)
        await ep.recv(size)
        if int(size[0]) > MAX_HEADER:
            raise CodecError(f"header of {int(size[0])} bytes exceeds {MAX_HEADER}")
        started = time.perf_counter()
        raw = np.empty(int(size[0]), dtype=np.uint8)
        await ep.recv(raw)
        header = decode_header(raw.tobytes())
        buffers = []
        for spec in header["tensors"]:
            buf = np.empty(int(spec["nbytes"]), dtype=np.uint8)
            if buf.nbytes:
                await ep.recv(buf)
            buffers.append(buf)
        message = message_from(header, buffers)  # type: ignore[arg-type]
        await self.mailbox.put(message)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
        await ep.send(np.ones(1, dtype=np.uint8))

    async def close(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxSender(Sender):
    """A fresh endpoint per message (see UcxReceiver._serve for why none is kept)."""

    async def _endpoint(self, address: str) -> Any:
        host, port = split_address(address, "ucx")
        return await _ucxx().create_endpoint(host, port)

    async def send(self, address: str, message: Message) -> None:
        header, buffers = frame_header(message)
        raw = np.frombuffer(encode_header(header), dtype=np.uint8)
        started = time.perf_counter()
        ep = await self._endpoint(address)
        try:
            await ep.send(np.array([raw.nbytes], dtype=np.uint64))
            await ep.send(raw)
            for buf in buffers:
                if buf.nbytes:
                    await ep.send(np.frombuffer(buf, dtype=np.uint8))
            ack = np.empty(1, dtype=np.uint8)
            await ep.recv(ack)
        finally:
            with contextlib.suppress(Exception):
                await ep.close()
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    async def close(self) -> None:
        return None
