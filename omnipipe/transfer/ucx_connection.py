"""The receiver's side of one UCX connection: the tags it answers on and the replies it
sends. Its own module because both halves of the receiver answer senders: the landing
(transfer/ucx_landing.py) and the wire (transfer/ucx_receiver.py)."""

from __future__ import annotations

import contextlib
import functools
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnipipe.transfer.auth import REFUSED
from omnipipe.transfer.ucx import _LEN, DATA, REPLY, _tag
from omnipipe.transfer.ucx_worker import UcxWorker, array


def refusal(reason: str) -> Any:
    raw = reason.encode()[:4096]
    return array(np.frombuffer(bytearray(REFUSED + _LEN.pack(len(raw)) + raw), dtype=np.uint8))


@functools.cache
def _nowhere() -> Any:
    """One byte that declined DATA messages are received into: UCX ends a larger
    message's receive as truncated (moving none of a rendezvous message's data)."""
    return array(np.empty(1, dtype=np.uint8))


@functools.cache
def reply_buffer(raw: bytes) -> Any:
    """The ucxx buffer of a one-byte reply, made once (a wrapper costs µs per message)."""
    return array(np.frombuffer(bytearray(raw), dtype=np.uint8))


@dataclass
class Connection:
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
        """Sends `payload` (a ucxx buffer: reply_buffer or refusal) as the verdict."""
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
