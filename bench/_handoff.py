"""bench/transfer.py's omnipipe paths: a receiver process per backend that empties its
mailbox as a stage's worker does, and the sender's timed hand-offs to it (one tensor, KV
blocks, and idle CPU and wake-up cost).

    python bench/_handoff.py BACKEND   # the receiver: prints its address, then serves
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from _common import median  # (and the checkout on sys.path, for omnipipe)
from _procs import answer_of, answering_child, start_child

KIB = 1024
WAKE_GAP = 0.1
KV_BLOCKS, KV_BLOCK_BYTES = 256, 64 * KIB


async def _serve_omnipipe(backend: str) -> None:
    """Receiver process: print the address, then empty the mailbox in request order
    (freeing the KV blocks each message brought into the block table)."""
    from omnipipe.transfer import BlockTable, Mailbox, make_receiver

    mailbox = Mailbox()
    table = BlockTable(8 * KV_BLOCKS, KV_BLOCK_BYTES)  # room while the loop catches up
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    print(receiver.address, flush=True)
    i = 0
    try:
        while True:
            message = await mailbox.get(f"r{i}")
            table.free(message.block_ids)
            mailbox.discard(f"r{i}")
            i += 1
    finally:
        await receiver.close()


@dataclass
class Peer:
    """A receiver process: it takes messages r0, r1, ... out of its mailbox in turn."""

    proc: subprocess.Popen[str]
    address: str
    taken: int = 0

    def next_id(self) -> str:
        self.taken += 1
        return f"r{self.taken - 1}"


class Receivers:
    """A fresh receiver for each measurement; or (quick) one per backend for the whole run,
    all started at once: each start imports torch, and a dozen of them one after another
    were most of a smoke run."""

    def __init__(self, env: dict[str, str], quick: bool, backends: tuple[str, ...]) -> None:
        self.env, self.quick = env, quick
        self.kept: dict[str, Peer] = {}
        self.starting = {b: start_child(self._argv(b), env) for b in backends if quick}

    @staticmethod
    def _argv(backend: str) -> list[str]:
        return [sys.executable, __file__, backend]

    @contextmanager
    def peer(self, backend: str) -> Iterator[Peer]:
        if backend in self.starting:
            proc = self.starting.pop(backend)
            self.kept[backend] = Peer(proc, answer_of(proc))
        if backend in self.kept:
            yield self.kept[backend]
            return
        peer = Peer(*answering_child(self._argv(backend), self.env))
        try:
            yield peer
        finally:
            _stop(peer.proc)

    def close(self) -> None:
        for proc in [*self.starting.values(), *(peer.proc for peer in self.kept.values())]:
            _stop(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=30)


async def _send_omnipipe(
    backend: str,
    peer: Peer,
    size: int,
    n: int,
    blocks: bool = False,
    gap: float = 0.0,
    lean: bool = False,
) -> list[float]:
    """n hand-offs of `size` bytes: one tensor, or (blocks) KV_BLOCKS blocks picked at
    random from a paged cache twice as large; `gap`: seconds idle before each. lean
    (--quick): only the data sent is made, as each random 64 MiB costs a smoke run ~0.3 s."""
    import torch

    from omnipipe.transfer import Message, make_sender

    sender = make_sender(backend)
    payload, cache = {}, torch.empty(0, dtype=torch.uint8)
    if not (lean and blocks):
        payload = {"x": torch.randint(0, 256, (size,), dtype=torch.uint8)}
    if blocks or not lean:
        cache = torch.randint(0, 256, (4 * KV_BLOCKS, KV_BLOCK_BYTES), dtype=torch.uint8)
    times = []
    try:
        for _ in range(n):
            if blocks:
                picked = torch.randperm(len(cache))[:KV_BLOCKS].tolist()
                message = Message(peer.next_id(), "bench", {}, blocks=[cache[j] for j in picked])
            else:
                message = Message(peer.next_id(), "bench", payload)
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter()
            await sender.send(peer.address, message)
            times.append(time.perf_counter() - started)
    finally:
        await sender.close()
    return times


def kv_run(receivers: Receivers, backend: str, n: int, blocks: bool) -> list[float]:
    with receivers.peer(backend) as peer:
        size = KV_BLOCKS * KV_BLOCK_BYTES
        times = asyncio.run(
            _send_omnipipe(backend, peer, size, n + 3, blocks=blocks, lean=receivers.quick)
        )
        return times[3:]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _idle_and_wake(backend: str, peer: Peer, n: int, idle_s: float) -> dict[str, float]:
    """Idle CPU of both ends over `idle_s` after a hand-off, then 4 KiB hand-offs
    back to back (hot) and each after WAKE_GAP idle (cold): the difference is what
    sleeping on the event fd costs the first message."""
    import resource

    import torch

    from omnipipe.transfer import Message, make_sender

    sender = make_sender(backend)
    payload = {"x": torch.randint(0, 256, (4 * KIB,), dtype=torch.uint8)}
    try:
        for _ in range(3):
            await sender.send(peer.address, Message(peer.next_id(), "bench", payload))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        pid = peer.proc.pid
        own, theirs, started = usage.ru_utime + usage.ru_stime, _cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(idle_s)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        elapsed = time.monotonic() - started
        sender_cpu = (usage.ru_utime + usage.ru_stime - own) / elapsed
        receiver_cpu = (_cpu_seconds(pid) - theirs) / elapsed
        hot: list[float] = []
        cold: list[float] = []
        for i in range(3, 3 + 2 * n):
            if i % 2:
                await asyncio.sleep(WAKE_GAP)
            started_send = time.perf_counter()
            await sender.send(peer.address, Message(peer.next_id(), "bench", payload))
            (cold if i % 2 else hot).append(time.perf_counter() - started_send)
    finally:
        await sender.close()
    return {
        "sender_idle_cpu": sender_cpu,
        "receiver_idle_cpu": receiver_cpu,
        "hot_p50_us": median(hot) * 1e6,
        "after_idle_p50_us": median(cold) * 1e6,
    }


def idle_run(receivers: Receivers, backend: str, n: int, idle_s: float) -> dict[str, float]:
    with receivers.peer(backend) as peer:
        return asyncio.run(_idle_and_wake(backend, peer, n, idle_s))


def omnipipe_run(receivers: Receivers, backend: str, size: int, n: int) -> list[float]:
    with receivers.peer(backend) as peer:
        warmup = 3
        times = asyncio.run(_send_omnipipe(backend, peer, size, n + warmup, lean=receivers.quick))
        return times[warmup:]


if __name__ == "__main__":
    asyncio.run(_serve_omnipipe(sys.argv[1]))
