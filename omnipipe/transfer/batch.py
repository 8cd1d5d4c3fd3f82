"""Several messages to one receiver as one transport message (issue #25: hand-offs per
engine step, not per token), shared by the TCP and UCX backends.

A batch frame's header is {"batch": [message header, ...]}, followed by each message's
tensors in order; the reply is BATCHED, u32 length, then a msgpack list with one
[outcome, reason] per message. The receiver never waits for a request's queue inside a
batch: a message whose queue is full now is answered BUSY (nothing reserved) and the
sender sends it again alone, which waits as a lone send does, so one slow request never
holds the acknowledgement of the others."""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from omnipipe.transfer.base import ACCEPTED, Outcome, Verdict
from omnipipe.transfer.codec import CodecError
from omnipipe.transfer.mailbox import Charge, Mailbox, MailboxFull
from omnipipe.transfer.message import Message

BATCHED = b"\x17"
_LEN = struct.Struct("!I")
BUSY = Verdict(Outcome.BUSY, "its request's queue is full")


def is_batch(header: dict[str, Any]) -> bool:
    return "batch" in header


def batch_reply(verdicts: list[Verdict], limit: int | None = None) -> bytes:
    """BATCHED, u32 length, the verdicts. With `limit`, reasons are cut so that the
    whole reply fits in `limit` bytes (UCX's reply buffer has a fixed size)."""
    reasons = [v.reason.encode() for v in verdicts]
    if limit is not None:
        # Each verdict packs in 3 bytes plus its reason (and up to 2 for the reason's
        # length); the list's own header takes up to 5.
        room = limit - len(BATCHED) - _LEN.size - 5 - 5 * len(verdicts)
        refused = sum(1 for v in verdicts if v.outcome is Outcome.REFUSED) or 1
        share = max(0, room // refused)
        reasons = [
            r[:share] if v.outcome is Outcome.REFUSED else b""
            for v, r in zip(verdicts, reasons, strict=True)
        ]
    raw: bytes = msgpack.packb(
        [
            [v.outcome.value, r.decode(errors="ignore")]
            for v, r in zip(verdicts, reasons, strict=True)
        ],
        use_bin_type=True,
    )
    reply = BATCHED + _LEN.pack(len(raw)) + raw
    if limit is not None and len(reply) > limit:
        raise CodecError(f"{len(verdicts)} verdicts do not fit in {limit} bytes")
    return reply


def read_verdicts(raw: bytes, count: int) -> list[Verdict]:
    """The verdicts of a batch of `count` messages from the reply's msgpack list."""
    try:
        answers = msgpack.unpackb(raw, raw=False)
        verdicts = [Verdict(Outcome(int(code)), str(reason)) for code, reason in answers]
    except (ValueError, TypeError) as exc:
        raise ConnectionError(f"a malformed batch reply: {exc}") from exc
    if len(verdicts) != count:
        raise ConnectionError(f"{len(verdicts)} verdicts for a batch of {count}")
    return verdicts


def admit(mailbox: Mailbox, request_id: str, nbytes: int) -> Charge | Verdict | None:
    """Room for one message of a batch, now or never: its charge, to receive it; None:
    its request already ended here (read it and drop it; ACK); else its verdict, to
    skip it: BUSY when the request's queue is full now, REFUSED over the mailbox's cap."""
    if not mailbox.has_room_now(request_id):
        return BUSY
    try:
        return mailbox.reserve(request_id, nbytes)
    except MailboxFull as exc:
        return Verdict(Outcome.REFUSED, str(exc))


def deliver(mailbox: Mailbox, message: Message, charge: Charge) -> Verdict:
    """Queues a received message of a batch without waiting: BUSY (its charge released)
    if another message of its request took the room meanwhile."""
    if not mailbox.has_room_now(message.request_id):
        mailbox.release(charge)
        return BUSY
    mailbox.put_nowait(message, charge)
    return ACCEPTED
