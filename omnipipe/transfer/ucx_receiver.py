"""The UCX receiver's wire half: the connection handshake, the CTRL messages taken as they
arrive, and batches, answered at once. The protocol is described in transfer/ucx.py; how an
admitted message's data lands, in transfer/ucx_landing.py. Imported only when the ucx
backend is selected."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from typing import Any

import numpy as np

from omnipipe.transfer import batch, ucx_worker
from omnipipe.transfer.auth import HANDSHAKE_TIMEOUT_SECONDS
from omnipipe.transfer.base import ACCEPTED, Outcome, Verdict
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_frame_header
from omnipipe.transfer.frames import declared_bytes, message_from
from omnipipe.transfer.mailbox import Charge
from omnipipe.transfer.message import stamp_received
from omnipipe.transfer.tcp import ACK, _recv_bytes
from omnipipe.transfer.ucx import (
    _CONN,
    _LEN,
    CTRL,
    CTRL_MAX,
    DEVICE_ACK,
    MAX_BATCH,
    MAX_WORKER_ADDRESS,
    RECEIVER_MASK,
    REPLY_MAX,
    _tag,
    restrict_net_devices,
)
from omnipipe.transfer.ucx_connection import Connection
from omnipipe.transfer.ucx_landing import Landing, LandingReceiver, block_count
from omnipipe.transfer.ucx_worker import UcxWorker, array

log = logging.getLogger(__name__)


class UcxReceiver(LandingReceiver):
    scheme = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conns: dict[int, Connection] = {}
        self._index = 0
        self._ctrl_tag: Any = None
        self._ctrl_mask: Any = None

    async def start(self) -> None:
        restrict_net_devices(self._host)
        self._ucx = ucx_worker.acquire()
        self._index = self._ucx.next_receiver_index()
        self._ctrl_tag = UcxWorker.tag(_tag(self._index, CTRL))
        self._ctrl_mask = UcxWorker.mask(RECEIVER_MASK)
        await super().start()
        self._ucx.add_poller(self._take_arrivals)
        self._ucx.add_poller(self._finish_landed)

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
        state = Connection(conn_id, ucx.endpoint(peer_address), sock=conn)
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
        while (probed := ucx.probe(self._ctrl_tag, self._ctrl_mask)) is not None:
            # A stage's chunks come in bursts: the next one is likely on its way.
            ucx.keep_polling()
            state = self._conns.get(int(probed.sender_tag.value) >> 8)
            if probed.length > CTRL_MAX:
                # Only an authenticated peer knows the tag: drop its connection.
                log.warning("dropping a %d-byte control message", probed.length)
                if state is not None:
                    state.drop()
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
        header = decode_frame_header(buf[_LEN.size : _LEN.size + size].tobytes())
        return header, _LEN.size + size

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

    def _try_now(self, state: Connection, buf: Any, request: Any) -> bool:
        """A hand-off taken without leaving the poller: the CTRL message is complete and
        the request's queue has room. False: leave it to _handle (which also reports a
        malformed message)."""
        try:
            request.check_error()
            header, offset = self._header(buf)
            if batch.is_batch(header):
                parsed = self._parse_batch(header["batch"], buf, offset)
            else:
                buffers, _ = self._inline_buffers(header, buf, offset)
        except Exception:
            return False
        if batch.is_batch(header):
            self._answer_batch(state, parsed, offset)
            return True
        if not self.mailbox.has_room_now(str(header.get("request_id"))):
            return False
        try:
            landing = self._admit(state, header, buffers, offset)
        except CodecError:
            return False  # nothing reserved yet: _handle reports it
        except Exception as exc:  # _admit dropped the connection
            log.warning("transfer connection %x: %s", state.conn, exc)
            return True
        if landing is None:
            return True  # answered: refused or dropped
        if landing.posted:
            self._landings.append(landing)  # _finish_landed completes it
        else:
            self._deliver_now(landing)
        return True

    def _parse_batch(
        self, subs: list[dict[str, Any]], buf: Any, offset: int
    ) -> list[tuple[dict[str, Any], list[Any], int]]:
        """A batch's messages, each with views of its inline tensors and their size;
        CodecError for a malformed one (only all-inline messages travel in a batch)."""
        if len(subs) > MAX_BATCH:
            raise CodecError(f"a batch of {len(subs)} messages (at most {MAX_BATCH})")
        parsed: list[tuple[dict[str, Any], list[Any], int]] = []
        for sub in subs:
            if block_count(sub):
                raise CodecError("KV blocks travel alone, not in a batch")
            buffers, large = self._inline_buffers(sub, buf, offset)
            if large:
                raise CodecError("a batched message with tensors outside its CTRL message")
            nbytes = declared_bytes(sub)
            parsed.append((sub, buffers, nbytes))
            offset += nbytes
        return parsed

    def _answer_batch(
        self,
        state: Connection,
        parsed: list[tuple[dict[str, Any], list[Any], int]],
        header_bytes: int,
    ) -> None:
        """Every message of a batch taken or answered now (none waits for room), and
        the verdicts sent back in one reply."""
        share = header_bytes // len(parsed)
        started = time.perf_counter()
        device = self._ucx is not None and self._ucx.device_memory
        self.stats.on_frame()
        verdicts: list[Verdict] = []
        for sub, buffers, nbytes in parsed:
            room = batch.admit(self.mailbox, str(sub.get("request_id")), nbytes + share)
            if not isinstance(room, Charge):
                verdicts.append(ACCEPTED if room is None else room)
                continue
            try:
                message = message_from(sub, buffers, to_device=device)
            except Exception as exc:  # a tensor it cannot rebuild: that message alone
                self.mailbox.release(room)
                verdicts.append(Verdict(Outcome.REFUSED, f"could not take it: {exc}"))
                continue
            seconds = stamp_received(message, started)
            verdicts.append(batch.deliver(self.mailbox, message, room))
            self.stats.on_transfer(message.nbytes, seconds)
        reply = batch.batch_reply(verdicts, REPLY_MAX)
        state.reply(array(np.frombuffer(bytearray(reply), dtype=np.uint8)))

    async def _handle(self, state: Connection, buf: Any, request: Any) -> None:
        """The general path: a CTRL message still arriving, or a request whose queue is
        full (back-pressure: the sender waits for the ACK)."""
        ucx = self._ucx
        assert ucx is not None
        landing: Landing | None = None
        try:
            await ucx.until(lambda: bool(request.completed), state.is_alive)
            request.check_error()
            header, offset = self._header(buf)
            if batch.is_batch(header):
                parsed = self._parse_batch(header["batch"], buf, offset)
                self._answer_batch(state, parsed, offset)
                return
            buffers, _ = self._inline_buffers(header, buf, offset)
            landing = self._admit(state, header, buffers, offset)
            if landing is None:
                return
            await ucx.until(landing.landed, state.is_alive)
            message = self._message(landing)
            if message is not None:
                await self._deliver(landing, message)
            landing = None
        except (CodecError, ConnectionError) as exc:
            state.drop()
            if landing is not None:
                self._abandon(landing, str(exc))
                landing = None
            else:
                log.warning("transfer connection %x: %s", state.conn, exc)
            ucx.wake_sleepers()
        except Exception as exc:
            if not isinstance(exc, ucx_worker.ucx_errors()):
                raise
            log.warning("transfer connection %x: %s", state.conn, exc)
            state.drop()
        finally:
            if landing is not None:
                self._abandon(landing, "the hand-off was cut short")

    async def close(self) -> None:
        await super().close()
        if self._ucx is not None:
            self._ucx.remove_poller(self._take_arrivals)
            self._ucx.remove_poller(self._finish_landed)
            self._landings.clear()
            for state in self._conns.values():
                state.alive = False
            ucx_worker.release(self._ucx)
            self._ucx = None
