"""The landing half of the UCX receiver: a message admitted to the mailbox has its large
tensors and KV blocks received straight into the memory they end up in, then is handed
to the mailbox and acknowledged. Apart from the wire half (transfer/ucx_receiver.py),
which decides what arrives, because this is where memory is reserved and given back."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omnipipe.transfer.base import BlockTableFull
from omnipipe.transfer.codec import CodecError
from omnipipe.transfer.frames import block_bytes, declared_bytes, message_from
from omnipipe.transfer.mailbox import Charge, MailboxFull
from omnipipe.transfer.message import Message, stamp_received
from omnipipe.transfer.tcp import ACK, ListeningReceiver
from omnipipe.transfer.ucx import DROPPED
from omnipipe.transfer.ucx_connection import Connection, refusal, reply_buffer
from omnipipe.transfer.ucx_worker import UcxWorker, array

log = logging.getLogger(__name__)


@dataclass
class Landing:
    """A message admitted to the mailbox whose large tensors and KV blocks are still
    arriving, each straight into the buffer (or block-table row) it ends up in."""

    state: Connection
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


def block_count(header: dict[str, Any]) -> int:
    block_bytes(header)  # raises CodecError on a malformed block spec
    blocks = header.get("blocks") or {}
    return int(blocks.get("count", 0))


class LandingReceiver(ListeningReceiver):
    """A receiver whose admitted messages land straight in the memory they end up in. It
    holds the UCX worker (set while started) and the messages still landing, which its
    poller _finish_landed delivers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ucx: UcxWorker | None = None
        self._landings: list[Landing] = []

    def _admit(
        self, state: Connection, header: dict[str, Any], buffers: list[Any], offset: int
    ) -> Landing | None:
        """Reserves mailbox room (and KV rows) for a message, then posts a receive for
        each large tensor and block straight into the memory it ends up in. None when it
        is answered already: refused, or dropped (the request ended)."""
        data_messages = sum(b is None for b in buffers) + (1 if block_count(header) else 0)
        nbytes = declared_bytes(header) + offset
        self.stats.on_frame()  # past what a malformed message raises: counted once
        try:
            charge = self.mailbox.reserve(str(header.get("request_id")), nbytes)
        except MailboxFull as exc:
            state.decline(data_messages, refusal(str(exc)))
            return None
        if charge is None:  # the request already ended here: a late chunk, dropped
            state.decline(data_messages, reply_buffer(DROPPED))
            return None
        try:
            ids = self._allocate_blocks(header)
        except BlockTableFull as exc:
            self.mailbox.release(charge)
            state.decline(data_messages, refusal(str(exc)))
            return None
        landing = Landing(state, header, buffers, ids, charge, time.perf_counter())
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

    def _blocks_target(self, landing: Landing) -> Any:
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

    def _deliver_now(self, landing: Landing) -> None:
        message = self._message(landing)
        if message is None:
            return
        if self.mailbox.has_room_now(message.request_id):
            self.mailbox.put_nowait(message, self._queued(landing, message))
            landing.state.reply(reply_buffer(ACK))
        else:  # another message of the request took the room meanwhile: wait for it
            self._track(asyncio.create_task(self._deliver(landing, message)))

    async def _deliver(self, landing: Landing, message: Message) -> None:
        charge = self._queued(landing, message)
        await self.mailbox.put(message, charge)
        landing.state.reply(reply_buffer(ACK))

    def _queued(self, landing: Landing, message: Message) -> Charge:
        """Hands the charge (and the rows, through on_drop) over to the mailbox."""
        charge, landing.charge, landing.ids = landing.charge, None, []
        assert charge is not None
        self.stats.on_transfer(message.nbytes, stamp_received(message, landing.started))
        return charge

    def _message(self, landing: Landing) -> Message | None:
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
            landing.state.reply(refusal(f"could not take the message: {exc}"))
        return None

    def _abandon(self, landing: Landing, why: str) -> None:
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
