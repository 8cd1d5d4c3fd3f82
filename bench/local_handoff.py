"""A co-located group's hand-off (transfer/local.py: LocalFirstSender into the next
stage's Mailbox, by reference) against what the same tensor costs to copy once on its
device: p50 microseconds per hand-off, send to take, for tensors of 4 KiB to 256 MiB.

On a GPU (`--device cuda`) this is the co-location case the 2-core VM cannot show: a
stage's output stays in GPU memory and the next stage reads the same storage, where a
process per stage would move it (device to host, across, host to device; UCX with
CUDA support, GPU to GPU). The copy column is one device-to-device clone, a floor under
any hand-off that copies. A view of a larger tensor is compacted into its own storage
(one copy, its own size): the third column.

    python bench/local_handoff.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch
from _common import median, record, table

from omnipipe.transfer import LocalExchange, LocalFirstSender, Mailbox, Message, TransferStats
from omnipipe.transfer.base import Sender

HERE = "tcp://127.0.0.1:8102"
SIZES = (4 << 10, 1 << 20, 16 << 20, 256 << 20)


class NoNetwork(Sender):
    """Every address of the run is local: a message that reaches the network is a bug."""

    async def send(self, address: str, message: Message) -> None:
        raise AssertionError(f"a hand-off to {address} went to the network")

    async def close(self) -> None:
        pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


async def hand_offs(tensor: torch.Tensor, rounds: int, view: bool) -> list[float]:
    """Seconds per hand-off of `tensor` (or of a view of half of it), send to take."""
    mailbox = Mailbox(max_bytes=4 * tensor.nbytes + (1 << 20))
    exchange = LocalExchange(False)
    exchange.register(HERE, mailbox, TransferStats(lambda _n, _s: None))
    sender = LocalFirstSender(NoNetwork(), exchange)
    sent = tensor[: tensor.numel() // 2] if view else tensor
    times = []
    for i in range(rounds):
        sync(tensor.device)
        started = time.perf_counter()
        await sender.send(HERE, Message(f"r{i}", "thinker", {"x": sent}, final=True))
        got = await mailbox.get(f"r{i}")
        sync(tensor.device)
        times.append(time.perf_counter() - started)
        same = got.tensors["x"].data_ptr() == sent.data_ptr()
        assert same != view, "by reference unless a view, which is compacted"
        mailbox.discard(f"r{i}")
    return times


def copies(tensor: torch.Tensor, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        sync(tensor.device)
        started = time.perf_counter()
        tensor.clone()
        sync(tensor.device)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="two sizes, 20 rounds")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = SIZES[:2] if args.quick else SIZES
    rounds = 20 if args.quick else args.rounds
    results: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    rows = []
    for size in sizes:
        tensor = torch.randn(size // 4, device=device)
        asyncio.run(hand_offs(tensor, 5, view=False))  # one-time costs
        local = median(asyncio.run(hand_offs(tensor, rounds, view=False))) * 1e6
        compacted = median(asyncio.run(hand_offs(tensor, rounds, view=True))) * 1e6
        copy = median(copies(tensor, rounds)) * 1e6
        results[str(size)] = {"local_us": local, "view_us": compacted, "copy_us": copy}
        rows.append(
            [
                f"{size >> 10} KiB",
                f"{local:.1f}",
                f"{compacted:.1f}",
                f"{copy:.1f}",
                f"{copy / local:.1f}x",
            ]
        )
    print(
        table(
            ["size", "by reference µs", "a half view µs", "one clone µs", "clone/reference"],
            rows,
        )
    )
    record("local_handoff", {**results, "rounds": rounds}, args.quick)
    ratios = {
        size >> 10: results[str(size)]["copy_us"] / results[str(size)]["local_us"] for size in sizes
    }
    summary = " ".join(f"s{kib}k_clone_over_reference={r:.1f}" for kib, r in ratios.items())
    print(f"local_handoff: device={device.type} {summary}")


if __name__ == "__main__":
    main()
