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

from omnipipe.transfer import batch, ucx_worker
from omnipipe.transfer.auth import HANDSHAKE_TIMEOUT_SECONDS, REFUSED
from omnipipe.transfer.base import (
    ACCEPTED,
    BlockTableFull,
    Outcome,
    Verdict,
)
from omnipipe.transfer.codec import MAX_HEADER, CodecError, decode_frame_header
from omnipipe.transfer.frames import block_bytes, declared_bytes, message_from
from omnipipe.transfer.mailbox import Charge, MailboxFull
from omnipipe.transfer.message import Message, stamp_received
from omnipipe.transfer.tcp import ACK, ListeningReceiver, _recv_bytes
from omnipipe.transfer.ucx import (
    _CONN,
    _LEN,
    CTRL,
    CTRL_MAX,
    DATA,
    DEVICE_ACK,
    DROPPED,
    MAX_BATCH,
    MAX_WORKER_ADDRESS,
    RECEIVER_MASK,
    REPLY,
    REPLY_MAX,
    _tag,
    restrict_net_devices,
)
from omnipipe.transfer.ucx_worker import UcxWorker, array

log = logging.getLogger(__name__)


def _refusal(reason: str) -> Any:
    raw = reason.encode()[:4096]
    return array(np.frombuffer(bytearray(REFUSED + _LEN.pack(len(raw)) + raw), dtype=np.uint8))


@functools.cache
def _nowhere() -> Any:
    """One byte that declined DATA messages are received into: UCX ends a larger
    message's receive as truncated (moving none of a rendezvous message's data)."""
    return array(np.empty(1, dtype=np.uint8))


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
    # The rendezvous socket: closing it is how the sender learns the connection ended.
    sock: socket.socket | None = None

    def __post_init__(self) -> None:
        self.reply_tag = UcxWorker.tag(_tag(self.conn, REPLY))
        self.data_tag = UcxWorker.tag(_tag(self.conn, DATA))

    def is_alive(self) -> bool:
        return self.alive

    def drop(self) -> None:
        """Ends a connection this side cannot serve: the sender sees its rendezvous
        socket close and fails the hand-off, instead of waiting for a reply."""
        self.alive = False
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def reply(self, payload: Any) -> None:
        """Sends `payload` (a ucxx buffer: _verdict or _refusal) as the verdict."""
        if self.pending:
            self.pending = [(r, b) for r, b in self.pending if not r.completed]
        self.pending.append((self.endpoint.tag_send(payload, self.reply_tag), payload))

    def decline(self, data_messages: int, payload: Any) -> None:
        """Answers a message that is not taken: its DATA messages (already sent) are
        received into nothing first, which ends the sender's sends."""
        nowhere = _nowhere()
        for _ in range(data_messages):
            self.pending.append((self.endpoint.tag_recv(nowhere, self.data_tag), nowhere))
        self.reply(payload)


@dataclass
class _Landing:
    """A message admitted to the mailbox whose large tensors and KV blocks are still
    arriving, each straight into the buffer (or block-table row) it ends up in."""

    state: _Connection
    header: dict[str, Any]
    buffers: list[Any]
    ids: list[int]
    charge: Charge | None
    started: float
    rows: list[torch.Tensor] = field(default_factory=list)
    posted: list[Any] = field(default_factory=list)
    # The blocks, received in one piece, when their rows are not adjacent.
    staged: Any = None

    def landed(self) -> bool:
        return all(r.completed for r in self.posted)


def _block_count(header: dict[str, Any]) -> int:
    block_bytes(header)  # raises CodecError on a malformed block spec
    blocks = header.get("blocks") or {}
    return int(blocks.get("count", 0))


class UcxReceiver(ListeningReceiver):
    scheme = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ucx: UcxWorker | None = None
        self._conns: dict[int, _Connection] = {}
        self._index = 0
        self._ctrl_tag: Any = None
        self._ctrl_mask: Any = None
        self._landings: list[_Landing] = []

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
        state = _Connection(conn_id, ucx.endpoint(peer_address), sock=conn)
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

    def _try_now(self, state: _Connection, buf: Any, request: Any) -> bool:
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
            if _block_count(sub):
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
        state: _Connection,
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

    def _admit(
        self, state: _Connection, header: dict[str, Any], buffers: list[Any], offset: int
    ) -> _Landing | None:
        """Reserves mailbox room (and KV rows) for a message, then posts a receive for
        each large tensor and block straight into the memory it ends up in. None when it
        is answered already: refused, or dropped (the request ended)."""
        data_messages = sum(b is None for b in buffers) + (1 if _block_count(header) else 0)
        nbytes = declared_bytes(header) + offset
        self.stats.on_frame()  # past what a malformed message raises: counted once
        try:
            charge = self.mailbox.reserve(str(header.get("request_id")), nbytes)
        except MailboxFull as exc:
            state.decline(data_messages, _refusal(str(exc)))
            return None
        if charge is None:  # the request already ended here: a late chunk, dropped
            state.decline(data_messages, _verdict(DROPPED))
            return None
        try:
            ids = self._allocate_blocks(header)
        except BlockTableFull as exc:
            self.mailbox.release(charge)
            state.decline(data_messages, _refusal(str(exc)))
            return None
        landing = _Landing(state, header, buffers, ids, charge, time.perf_counter())
        try:
            if ids and self.block_table is not None:
                landing.rows = self.block_table.rows(ids)
            # Receives go in the order the sender sends: tensors, then blocks.
            for i, b in enumerate(buffers):
                if b is None:
                    buffers[i] = self._receive_buffer(header["tensors"][i])
                    landing.posted.append(
                        state.endpoint.tag_recv(array(buffers[i]), state.data_tag)
                    )
            if landing.rows:
                landing.posted.append(
                    state.endpoint.tag_recv(array(self._blocks_target(landing)), state.data_tag)
                )
        except BaseException:
            state.drop()  # its DATA messages stay unmatched: the connection ends
            self._abandon(landing, "could not post the receives")
            raise
        if landing.posted and self._ucx is not None:
            self._ucx.keep_polling()  # the data is on its way
        return landing

    def _blocks_target(self, landing: _Landing) -> Any:
        """Where the gathered blocks land: their rows, if adjacent, else a buffer."""
        table, ucx = self.block_table, self._ucx
        assert table is not None
        assert ucx is not None
        run = table.run(landing.ids)
        if run is not None:
            return run.numpy().reshape(-1)
        landing.staged = ucx.pool.take(len(landing.ids) * table.block_bytes)
        return landing.staged

    def _finish_landed(self) -> None:
        """A poller: completes each admitted message whose data has all arrived."""
        if not self._landings:
            return
        waiting = []
        for landing in self._landings:
            if landing.landed():
                try:
                    self._deliver_now(landing)
                except Exception as exc:  # one message's failure must not jam the poller
                    landing.state.drop()
                    self._abandon(landing, f"could not deliver: {exc}")
            elif landing.state.alive:
                waiting.append(landing)
            else:
                self._abandon(landing, "the sender went away mid-transfer")
        self._landings = waiting

    def _deliver_now(self, landing: _Landing) -> None:
        message = self._message(landing)
        if message is None:
            return
        if self.mailbox.has_room_now(message.request_id):
            self.mailbox.put_nowait(message, self._queued(landing, message))
            landing.state.reply(_verdict(ACK))
        else:  # another message of the request took the room meanwhile: wait for it
            self._track(asyncio.create_task(self._deliver(landing, message)))

    async def _deliver(self, landing: _Landing, message: Message) -> None:
        charge = self._queued(landing, message)
        await self.mailbox.put(message, charge)
        landing.state.reply(_verdict(ACK))

    def _queued(self, landing: _Landing, message: Message) -> Charge:
        """Hands the charge (and the rows, through on_drop) over to the mailbox."""
        charge, landing.charge, landing.ids = landing.charge, None, []
        assert charge is not None
        self.stats.on_transfer(message.nbytes, stamp_received(message, landing.started))
        return charge

    def _message(self, landing: _Landing) -> Message | None:
        """The message, once its data has landed; None (and the connection dropped, or
        the error logged) when it cannot be built."""
        try:
            for r in landing.posted:
                r.check_error()
            if landing.staged is not None and self.block_table is not None:
                self.block_table.scatter(landing.ids, torch.from_numpy(landing.staged))
                landing.staged = None
            return self._owning_rows(
                message_from(
                    landing.header,
                    landing.buffers,
                    landing.ids,
                    landing.rows,
                    to_device=self._ucx is not None and self._ucx.device_memory,
                )
            )
        except CodecError as exc:
            landing.state.drop()
            self._abandon(landing, str(exc))
        except Exception as exc:  # a receive failed, or no room on the device: refused
            self._abandon(landing, str(exc))
            landing.state.reply(_refusal(f"could not take the message: {exc}"))
        return None

    def _abandon(self, landing: _Landing, why: str) -> None:
        log.warning("transfer connection %x: %s", landing.state.conn, why)
        if landing.charge is not None:
            self.mailbox.release(landing.charge)
            landing.charge = None
        # A receive still posted may yet write into its rows: they stay out of use, and
        # its buffers stay alive (held by the connection) until it completes.
        if landing.ids and self.block_table is not None and landing.landed():
            self.block_table.free(landing.ids)
        landing.state.pending += [(r, landing) for r in landing.posted if not r.completed]
        if not landing.state.alive and self._ucx is not None:
            self._ucx.wake_sleepers()

    def _receive_buffer(self, spec: dict[str, Any]) -> Any:
        """Device memory for a tensor sent from it, when this worker takes it (the
        `gpu` tests, run on an H100); else a pooled host buffer."""
        ucx = self._ucx
        assert ucx is not None
        nbytes = int(spec["nbytes"])
        if spec.get("direct") and ucx.device_memory:
            return torch.empty(nbytes, dtype=torch.uint8, device=str(spec["device"]))
        return ucx.pool.take(nbytes)

    async def _handle(self, state: _Connection, buf: Any, request: Any) -> None:
        """The general path: a CTRL message still arriving, or a request whose queue is
        full (back-pressure: the sender waits for the ACK)."""
        ucx = self._ucx
        assert ucx is not None
        landing: _Landing | None = None
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
