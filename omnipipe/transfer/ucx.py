"""UCX backend (ucxx): the same frames as TCP, carried as UCX active messages over
persistent endpoints, which pick shared memory, CMA, TCP or RDMA as the hardware allows.
Imported only when selected."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from typing import Any

import numpy as np

from omnipipe.transfer.base import Message, Receiver, Sender, split_address
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_header, encode_header
from omnipipe.transfer.tcp import frame_header, message_from

# Small tensors travel inside the frame (one active message carries a whole small
# hand-off); larger ones follow as their own active messages, sent from their memory.
INLINE_MAX = 64 * 1024
_LEN = struct.Struct("!I")
_ACK = np.ones(1, dtype=np.uint8)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Without it ucxx awaits a request by polling it from the event loop, so a receive left
# pending on an idle endpoint burns a core; with it a notifier thread completes Python
# futures, an idle worker sleeps, and endpoints can stay open between messages.
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
        self._listener = _Context.acquire().create_listener(self._serve, self._port)
        self._port = self._listener.port

    async def _serve(self, ep: Any) -> None:
        """Messages, one after another, until the sender closes the endpoint."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            while True:
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
        frame = await ep.am_recv()
        started = time.perf_counter()
        (size,) = _LEN.unpack(frame[: _LEN.size].tobytes())
        if size > MAX_HEADER:
            raise CodecError(f"header of {size} bytes exceeds {MAX_HEADER}")
        offset = _LEN.size + size
        header = decode_header(frame[_LEN.size : offset].tobytes())
        buffers = []
        for spec in header["tensors"]:
            nbytes = int(spec["nbytes"])
            if nbytes <= INLINE_MAX:
                buffers.append(frame[offset : offset + nbytes])
                offset += nbytes
            else:
                buffers.append(await ep.am_recv())
        message = message_from(header, buffers)
        await self.mailbox.put(message)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
        await ep.am_send(_ACK)

    async def close(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            _Context.release()


class UcxSender(Sender):
    """Keeps idle endpoints per address; concurrent sends open more."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle: dict[str, list[Any]] = {}
        self._acquired = False

    async def _endpoint(self, address: str) -> Any:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
        host, port = split_address(address, "ucx")
        if not self._acquired:
            _Context.acquire()
            self._acquired = True
        return await _ucxx().create_endpoint(host, port)

    async def send(self, address: str, message: Message) -> None:
        header, buffers = frame_header(message)
        raw = encode_header(header)
        inline = [b for b in buffers if len(b) <= INLINE_MAX]
        large = [b for b in buffers if len(b) > INLINE_MAX]
        frame = np.frombuffer(b"".join([_LEN.pack(len(raw)), raw, *inline]), dtype=np.uint8)
        started = time.perf_counter()
        ep = await self._endpoint(address)
        try:
            await ep.am_send(frame)
            for buf in large:
                await ep.am_send(np.frombuffer(buf, dtype=np.uint8))
            await ep.am_recv()  # the ack: the message is in the receiver's mailbox
        except BaseException:
            with contextlib.suppress(Exception):
                await ep.close()
            raise
        self._idle.setdefault(address, []).append(ep)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)

    async def close(self) -> None:
        for endpoints in self._idle.values():
            for ep in endpoints:
                with contextlib.suppress(Exception):
                    await ep.close()
        self._idle.clear()
        if self._acquired:
            self._acquired = False
            _Context.release()
