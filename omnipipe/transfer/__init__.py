"""Stage-to-stage tensor hand-off: msgpack header + raw buffers, never pickle.

One interface (Sender / Receiver / Mailbox), two backends: ucx (ucxx) and tcp (asyncio);
stages of one process hand off by reference (local: LocalFirstSender).
"""

from omnipipe.transfer.aliasing import CHECK_ALIASING_ENV, AliasingError
from omnipipe.transfer.auth import CREDENTIAL_ENV, TransferRefused
from omnipipe.transfer.base import (
    BlockTable,
    BlockTableFull,
    Receiver,
    Sender,
    TransferStats,
)
from omnipipe.transfer.factory import make_receiver, make_sender
from omnipipe.transfer.local import LocalExchange, LocalFirstSender
from omnipipe.transfer.mailbox import (
    DEFAULT_MAX_BYTES,
    UNCLAIMED_SHARE,
    Charge,
    Mailbox,
    MailboxFull,
)
from omnipipe.transfer.message import Message

__all__ = [
    "CHECK_ALIASING_ENV",
    "CREDENTIAL_ENV",
    "DEFAULT_MAX_BYTES",
    "UNCLAIMED_SHARE",
    "AliasingError",
    "BlockTable",
    "BlockTableFull",
    "Charge",
    "LocalExchange",
    "LocalFirstSender",
    "Mailbox",
    "MailboxFull",
    "Message",
    "Receiver",
    "Sender",
    "TransferRefused",
    "TransferStats",
    "make_receiver",
    "make_sender",
]
