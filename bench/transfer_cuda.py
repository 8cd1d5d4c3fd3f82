"""CUDA tensors between two processes on one GPU: omnipipe's ucx backend (device memory
sent and received as it is, no host bounce) beside a same-process device copy (the
anchor), raw ucxx moving the same device buffers with no framing (busy-polling), a
same-process host bounce (device -> host -> device) and the tcp backend (which bounces
through the host by design).

Each received tensor is checked: on the GPU, and holding the round's fill value.

    python bench/transfer_cuda.py [--quick]      (needs CUDA and a CUDA-enabled UCX)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _raw_ucxx
from _common import median, record, table
from _procs import answering_child

KIB, MIB = 1024, 1024 * 1024
SIZES = {"4KiB": 4 * KIB, "1MiB": MIB, "64MiB": 64 * MIB, "256MiB": 256 * MIB}
ITERATIONS = {"4KiB": 1000, "1MiB": 300, "64MiB": 50, "256MiB": 20}
QUICK_ITERATIONS = {"4KiB": 50, "1MiB": 20, "64MiB": 5, "256MiB": 3}
WARMUP = 3
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _fill(round_no: int) -> int:
    return round_no % 251


# ---- omnipipe backends --------------------------------------------------------------


async def _serve_omnipipe(backend: str) -> None:
    """Receiver: checks each message is on the GPU (ucx) and holds its round's value."""
    from omnipipe.transfer import Mailbox, make_receiver

    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    print(receiver.address, flush=True)
    i = 0
    try:
        while True:
            got = (await mailbox.get(f"r{i}")).tensors["x"]
            if backend == "ucx" and not got.is_cuda:
                sys.exit(f"round {i}: the ucx backend delivered a {got.device} tensor")
            want = _fill(i)
            if int(got[0]) != want or int(got[-1]) != want:
                sys.exit(f"round {i}: wrong data ({int(got[0])}, want {want})")
            mailbox.discard(f"r{i}")
            del got
            i += 1
    finally:
        await receiver.close()


async def _send_omnipipe(backend: str, address: str, size: int, n: int) -> list[float]:
    import torch

    from omnipipe.transfer import Message, make_sender

    sender = make_sender(backend)
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    times = []
    try:
        for i in range(n):
            x.fill_(_fill(i))
            torch.cuda.synchronize()
            started = time.perf_counter()
            await sender.send(address, Message(f"r{i}", "bench", {"x": x}))
            times.append(time.perf_counter() - started)
    finally:
        await sender.close()
    return times


def omnipipe_run(backend: str, size: int, n: int) -> list[float]:
    proc, address = answering_child([sys.executable, __file__, "--serve", backend], ENV)
    try:
        return asyncio.run(_send_omnipipe(backend, address, size, n + WARMUP))[WARMUP:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.returncode not in (0, -15):
            raise RuntimeError(f"the {backend} receiver failed (exit {proc.returncode})")


# ---- raw ucxx on device buffers ------------------------------------------------------


def _serve_raw_ucxx(size: int) -> None:
    import torch

    _raw_ucxx.serve(torch.empty(size, dtype=torch.uint8, device="cuda"))


def raw_ucxx_run(size: int, n: int) -> list[float]:
    import torch

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    argv = [sys.executable, __file__, "--serve", f"raw-ucxx:{size}"]
    return _raw_ucxx.ping(argv, ENV, data, n, WARMUP)


# ---- same-process anchors --------------------------------------------------------------


def _device_timed(n: int, step: Callable[[], object]) -> list[float]:
    """Times `step` with the device idle before and finished after it."""
    import torch

    times = []
    for _ in range(n + WARMUP):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[WARMUP:]


def device_copy_run(size: int, n: int) -> list[float]:
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _device_timed(n, lambda: dst.copy_(src))


def host_bounce_run(size: int, n: int) -> list[float]:
    """Device -> pinned host -> device in one process: what any host bounce costs."""
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src)
    return _device_timed(n, lambda: dst.copy_(host.copy_(src)))


def timed_row(times: list[float], size: int) -> dict[str, float]:
    return {
        "gbps": size * len(times) / sum(times) / 1e9,
        "p50_us": median(times) * 1e6,
    }


def describe_gpu() -> dict[str, object]:
    import torch
    import ucxx._lib.libucxx as lib

    context = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "ucx_cuda_support": bool(context.cuda_support),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke test)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve and args.serve.startswith("raw-ucxx:"):
        _serve_raw_ucxx(int(args.serve.partition(":")[2]))
        return
    if args.serve:
        asyncio.run(_serve_omnipipe(args.serve))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/transfer_cuda.py needs a CUDA device")
    gpu = describe_gpu()
    print(f"{gpu}", flush=True)
    if not gpu["ucx_cuda_support"]:
        sys.exit("this UCX was built without CUDA: nothing to measure")
    counts = QUICK_ITERATIONS if args.quick else ITERATIONS
    results: dict[str, dict[str, dict[str, float]]] = {}
    for size_name, n in counts.items():
        size = SIZES[size_name]
        print(f"[{size_name}] {n} hand-offs per path ...", flush=True)
        results[size_name] = {
            "device-copy": timed_row(device_copy_run(size, n), size),
            "host-bounce": timed_row(host_bounce_run(size, n), size),
            "raw-ucxx": timed_row(raw_ucxx_run(size, n), size),
            "omnipipe-ucx": timed_row(omnipipe_run("ucx", size, n), size),
            "omnipipe-tcp": timed_row(omnipipe_run("tcp", size, n), size),
        }
    rows = [
        [
            size_name,
            path,
            f"{r['gbps']:.3f}",
            f"{r['p50_us']:.1f}",
            f"{r['gbps'] / paths['device-copy']['gbps']:.3f}",
            f"{r['gbps'] / paths['raw-ucxx']['gbps']:.3f}",
        ]
        for size_name, paths in results.items()
        for path, r in paths.items()
    ]
    print()
    print(table(["size", "path", "GB/s", "p50 us", "vs device copy", "vs raw ucxx"], rows))
    print("(device copy and host bounce run in one process; the others between two)")
    record("transfer-cuda", {"gpu": gpu, **results}, args.quick)
    summary = {
        f"ucx_vs_{anchor.replace('-', '_')}_{s.lower()}": results[s]["omnipipe-ucx"]["gbps"]
        / results[s][anchor]["gbps"]
        for s in results
        for anchor in ("device-copy", "raw-ucxx", "omnipipe-tcp")
    }
    print("transfer-cuda: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
