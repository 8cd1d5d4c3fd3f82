"""What one stage hands the next: a Message. It sits below the mailbox and the transfer
interface (base.py), which both hold messages, so that their imports run one way."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Message:
    """One chunk of one request's output, from one stage to the next."""

    request_id: str
    source: str
    tensors: dict[str, torch.Tensor]
    chunk: int = 0
    final: bool = True
    meta: dict[str, Any] = field(default_factory=dict)
    # KV blocks (paged-cache layout): sent, each a contiguous tensor of the same size,
    # from wherever they lie; received, views of the receiver's BlockTable rows that
    # the transport wrote straight into, with their ids in `block_ids`.
    blocks: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # What gives back a received message's KV rows if the mailbox drops it unread (its
    # request cancelled or expired); a consumer that takes it frees them itself.
    on_drop: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # Received: (start, end) of its receipt, wall-clock nanoseconds, which a worker's trace
    # shows as the request's transfer-in. Local: never sent, never compared.
    received_ns: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def stamp_received(message: Message, started: float) -> float:
    """Records in the message when its receipt (begun at perf_counter() `started`) ran;
    returns its seconds."""
    seconds = time.perf_counter() - started
    end = time.time_ns()
    message.received_ns = (end - int(seconds * 1e9), end)
    return seconds
