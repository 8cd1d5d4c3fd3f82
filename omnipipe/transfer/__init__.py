"""Stage-to-stage tensor hand-off: msgpack header + raw buffers, never pickle.

One interface (Sender / Receiver / Mailbox), two backends: ucx (ucxx) and tcp (asyncio).
"""

from omnipipe.transfer.base import Mailbox, Message, Receiver, Sender, TransferStats
from omnipipe.transfer.factory import make_receiver, make_sender

__all__ = [
    "Mailbox",
    "Message",
    "Receiver",
    "Sender",
    "TransferStats",
    "make_receiver",
    "make_sender",
]
