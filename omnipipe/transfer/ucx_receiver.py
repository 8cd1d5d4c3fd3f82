"""The UCX receiver: the protocol is described in transfer/ucx.py. Imported only when
the ucx backend is selected."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnipipe.transfer import ucx_worker
from omnipipe.transfer.auth import HANDSHAKE_TIMEOUT_SECONDS, REFUSED
from omnipipe.transfer.base import BlockTableFull, MailboxFull
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_header
from omnipipe.transfer.tcp import ACK, ListeningReceiver, _recv_bytes, declared_bytes, message_from
from omnipipe.transfer.ucx import (
    _CONN,
    _LEN,
    CTRL,
    CTRL_MAX,
    DATA,
    DEVICE_ACK,
    DROPPED,
    GO,
    MAX_WORKER_ADDRESS,
    RECEIVER_MASK,
    REPLY,
    _tag,
    restrict_net_devices,
)
from omnipipe.transfer.ucx_worker import UcxWorker, array

log = logging.getLogger(__name__)


def _refusal(reason: str) -> Any:
    raw = reason.encode()[:4096]
    return array(np.frombuffer(bytearray(REFUSED + _LEN.pack(len(raw)) + raw), dtype=np.uint8))


@functools.cache
def _verdict(raw: bytes) -> Any:
    """The ucxx buffer of a one-byte reply, made once (a wrapper costs µs per message)."""
    return array(np.frombuffer(bytearray(raw), dtype=np.uint8))


@dataclass
class _Connection:
    """The receiver's side of one sender connection."""

    conn: int
    endpoint: Any
    alive: bool = True
    # Replies in flight: their buffers live until UCX is done with them.
    pending: list[tuple[Any, Any]] = field(default_factory=list)
    reply_tag: Any = None
    data_tag: Any = None

    def __post_init__(self) -> None:
        self.reply_tag = UcxWorker.tag(_tag(self.conn, REPLY))
        self.data_tag = UcxWorker.tag(_tag(self.conn, DATA))

    def is_alive(self) -> bool:
        return self.alive

    def reply(self, payload: Any) -> None:
        """Sends `payload` (a ucxx buffer: _verdict or _refusal) as the verdict."""
        if self.pending:
            self.pending = [(r, b) for r, b in self.pending if not r.completed]
        self.pending.append((self.endpoint.tag_send(payload, self.reply_tag), payload))


class UcxReceiver(ListeningReceiver):
    scheme = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ucx: UcxWorker | None = None
        self._conns: dict[int, _Connection] = {}
        self._index = 0
        self._ctrl_tag = 0

    async def start(self) -> None:
        restrict_net_devices(self._host)
        self._ucx = ucx_worker.acquire()
        self._index = self._ucx.next_receiver_index()
        self._ctrl_tag = _tag(self._index, CTRL)
        await super().start()
        self._ucx.add_poller(self._take_arrivals)

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

    def _take_arrivals(self) -> None:
        """Runs after each progress of the worker (a poller): takes every CTRL message
        that arrived for this receiver, whichever connection sent it, and finishes the
        all-inline ones on the spot; the rest go to a task."""
        ucx = self._ucx
        if ucx is None:
            return
        while (probed := ucx.probe(self._ctrl_tag, RECEIVER_MASK)) is not None:
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
            state.reply(_verdict(ACK))
            return True
        try:
            message = message_from(header, buffers)
        except Exception:
            self.mailbox.release(charge)
            return False
        self.mailbox.put_nowait(message, charge)
        self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
        state.reply(_verdict(ACK))
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
                state.reply(_verdict(DROPPED))
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
                data_tag = state.data_tag
                for i, b in enumerate(buffers):
                    if b is None:
                        buffers[i] = self._receive_buffer(header["tensors"][i])
                        posted.append(state.endpoint.tag_recv(array(buffers[i]), data_tag))
                for row in rows:
                    posted.append(state.endpoint.tag_recv(array(row.numpy()), data_tag))
                state.reply(_verdict(GO))
                await ucx.until(lambda: all(r.completed for r in posted), state.is_alive)
                for r in posted:
                    r.check_error()
            message = self._owning_rows(message_from(header, buffers, ids, rows))
            await self.mailbox.put(message, charge)
            charge, ids = None, []
            self.stats.on_transfer(message.nbytes, time.perf_counter() - started)
            state.reply(_verdict(ACK))
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
            self._ucx.remove_poller(self._take_arrivals)
            for state in self._conns.values():
                state.alive = False
            ucx_worker.release(self._ucx)
            self._ucx = None
