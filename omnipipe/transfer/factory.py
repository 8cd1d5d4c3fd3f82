"""Pick a transfer backend by name; ucxx is imported only when ucx is chosen."""

from __future__ import annotations

from omnipipe.transfer.auth import resolve_credential, warn_if_open
from omnipipe.transfer.base import BlockTable, Receiver, Sender, TransferStats
from omnipipe.transfer.mailbox import Mailbox


def make_receiver(
    backend: str,
    mailbox: Mailbox,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    stats: TransferStats | None = None,
    credential: str | None = None,
    block_table: BlockTable | None = None,
) -> Receiver:
    """`credential`: what senders must prove; None takes $OMNIPIPE_PIPELINE_CREDENTIAL.
    `block_table`: where messages' KV blocks land (a receiver without one refuses them)."""
    credential = resolve_credential(credential)
    warn_if_open(credential, "the transfer listener")
    if backend == "tcp":
        from omnipipe.transfer.tcp import TcpReceiver

        return TcpReceiver(mailbox, host, port, advertise_host, stats, credential, block_table)
    if backend == "ucx":
        from omnipipe.transfer.ucx_receiver import UcxReceiver

        return UcxReceiver(mailbox, host, port, advertise_host, stats, credential, block_table)
    raise ValueError(f"unknown transfer backend {backend!r}: use ucx or tcp")


def make_sender(
    backend: str, stats: TransferStats | None = None, credential: str | None = None
) -> Sender:
    """`credential`: what receivers must prove; None takes $OMNIPIPE_PIPELINE_CREDENTIAL."""
    credential = resolve_credential(credential)
    if backend == "tcp":
        from omnipipe.transfer.tcp import TcpSender

        return TcpSender(stats, credential)
    if backend == "ucx":
        from omnipipe.transfer.ucx import UcxSender

        return UcxSender(stats, credential)
    raise ValueError(f"unknown transfer backend {backend!r}: use ucx or tcp")
