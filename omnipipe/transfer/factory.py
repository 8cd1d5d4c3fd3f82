"""Pick a transfer backend by name; ucxx is imported only when ucx is chosen."""

from __future__ import annotations

from omnipipe.transfer.base import Mailbox, Receiver, Sender, TransferStats


def make_receiver(
    backend: str,
    mailbox: Mailbox,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    stats: TransferStats | None = None,
) -> Receiver:
    if backend == "tcp":
        from omnipipe.transfer.tcp import TcpReceiver

        return TcpReceiver(mailbox, host, port, advertise_host, stats)
    if backend == "ucx":
        from omnipipe.transfer.ucx import UcxReceiver

        return UcxReceiver(mailbox, host, port, advertise_host, stats)
    raise ValueError(f"unknown transfer backend {backend!r}: use ucx or tcp")


def make_sender(backend: str, stats: TransferStats | None = None) -> Sender:
    if backend == "tcp":
        from omnipipe.transfer.tcp import TcpSender

        return TcpSender(stats)
    if backend == "ucx":
        from omnipipe.transfer.ucx import UcxSender

        return UcxSender(stats)
    raise ValueError(f"unknown transfer backend {backend!r}: use ucx or tcp")
