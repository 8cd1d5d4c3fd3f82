"""Stage-to-stage hand-off between two processes on loopback: omnipipe's ucx and tcp
backends beside a single-process memcpy (the physical limit), raw ucxx (the library's
low-level API with no framing, busy-polling: the ucx backend's anchor), UCX's own
ucx_perftest (tag_bw / tag_lat, from Debian's ucx-utils), NIXL's DRAM-to-DRAM WRITE when
nixl_cu12 imports (bench/_nixl.py) and a plain Python socket send.
Then KV blocks (256 scattered 64 KiB blocks into the receiver's block table, against one
16 MiB tensor), and each backend's idle CPU and wake-up cost after idle.

A hand-off is what a stage does: send one message (msgpack header + raw tensor bytes)
and wait until the receiver has it in its mailbox (the ack). The receiver process takes
every message out of its mailbox, as a stage's worker does.

Every process runs as a stage's worker does, with THP_MEM_ALLOC_ENABLE=1 (the worker
image and `omnipipe serve` set it): torch then puts large tensors in transparent huge
pages, which CMA copies between processes at twice the speed of 4 KiB pages.
`--rounds N` runs each size's paths N times, interleaved, and reports the median round.

    .venv/bin/python bench/transfer.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

# Before torch is first imported (it reads this once), here and in every child.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import _nixl
import _raw_ucxx
from _common import REPO, median, percentile, record, table
from _handoff import KV_BLOCK_BYTES, KV_BLOCKS, WAKE_GAP, Receivers, idle_run, kv_run, omnipipe_run

from omnipipe.local.ports import free_port

KIB, MIB = 1024, 1024 * 1024
SIZES = {"4KiB": 4 * KIB, "1MiB": MIB, "64MiB": 64 * MIB}
ITERATIONS = {"4KiB": 2000, "1MiB": 200, "64MiB": 20}
QUICK_ITERATIONS = {"4KiB": 100, "1MiB": 10, "64MiB": 3}
# Idle CPU is read over this long; a smoke run only checks that it is read.
IDLE_SECONDS, QUICK_IDLE_SECONDS = 3.0, 0.5
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


# ---- raw ucxx: the library's own ping-pong, no framing ---------------------------------


def _serve_raw_ucxx(size: int) -> None:
    import numpy as np

    _raw_ucxx.serve(np.empty(size, dtype=np.uint8))


def _raw_ucxx_child(size: int) -> list[str]:
    os.environ.update(UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n")  # this end too
    return [sys.executable, __file__, "--serve", f"raw-ucxx:{size}"]


def raw_ucxx_run(size_name: str, n: int, shared: _raw_ucxx.RoundTrips | None) -> list[float]:
    """A hand-off's shape with nothing of ours: `size` random bytes one way, 8 back; to a
    child of its own, or through `shared` (--quick: one child, its buffer the largest)."""
    import numpy as np

    size = SIZES[size_name]
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    if shared is not None:
        return shared(data, n, 3)
    return _raw_ucxx.ping(_raw_ucxx_child(size), ENV, data, n, warmup=3)


def nixl_run(size: int, n: int) -> list[float]:
    """NIXL's sender in its own process too: nixl_cu12 crashes at interpreter exit."""
    out = subprocess.run(
        [sys.executable, __file__, "--serve", f"nixl-sender:{size}:{n}"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=600,
    ).stdout
    for line in out.splitlines():
        if line.startswith("times "):
            times: list[float] = json.loads(line.removeprefix("times "))
            return times
    raise RuntimeError(f"the NIXL sender gave no times:\n{out}")


# ---- plain socket --------------------------------------------------------------------


def _serve_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(f"{server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        buffer = bytearray(64 * MIB)
        with conn:
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                (length,) = struct.unpack("<Q", header)
                view, got = memoryview(buffer)[:length], 0
                while got < length:
                    got += conn.recv_into(view[got:], length - got)
                conn.sendall(b"k")


def socket_run(size_name: str, n: int) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "socket"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        payload = bytes(SIZES[size_name])
        frame = struct.pack("<Q", len(payload))
        times = []
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(n + 3):
                started = time.perf_counter()
                conn.sendall(frame)
                conn.sendall(payload)
                conn.recv(1)
                times.append(time.perf_counter() - started)
        return times[3:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- memcpy and ucx_perftest ---------------------------------------------------------


def memcpy_run(size_name: str, n: int) -> list[float]:
    import torch

    src = torch.randint(0, 256, (SIZES[size_name],), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(n + 3):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return times[3:]


FINAL = re.compile(r"^Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def perftest(test: str, size: int, n: int) -> tuple[float, float]:
    """(median overhead in seconds, average bandwidth in bytes/s) from ucx_perftest."""
    port = free_port()  # from this run's ports (OMNIPIPE_PORT_RANGE), as its serves' are
    server = subprocess.Popen(
        ["ucx_perftest", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        for _ in range(50):
            time.sleep(0.1)
            client = subprocess.run(
                [
                    *("ucx_perftest", "127.0.0.1", "-p", str(port)),
                    *("-t", test, "-s", str(size), "-n", str(n)),
                ],
                capture_output=True,
                text=True,
                env=ENV,
                timeout=300,
            )
            for line in client.stdout.splitlines():
                if m := FINAL.match(line.strip()):
                    return float(m[2]) * 1e-6, float(m[5]) * MIB
        raise RuntimeError(f"ucx_perftest {test} gave no result:\n{client.stdout}{client.stderr}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def perftest_row(size_name: str, n: int) -> dict[str, float]:
    size = SIZES[size_name]
    one_way, _ = perftest("tag_lat", size, n)
    _, bandwidth = perftest("tag_bw", size, n)
    # tag_lat reports half a round trip; a hand-off waits for the ack, a full one.
    return {"gbps": bandwidth / 1e9, "p50_us": 2 * one_way * 1e6, "p99_us": float("nan")}


def timed_row(times: list[float], size: int) -> dict[str, float]:
    return {
        "gbps": size * len(times) / sum(times) / 1e9,
        "p50_us": median(times) * 1e6,
        "p99_us": percentile(times, 0.99) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few iterations (smoke test)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each path, interleaved")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "socket":
        _serve_socket()
        return
    if args.serve and args.serve.startswith("raw-ucxx:"):
        _serve_raw_ucxx(int(args.serve.partition(":")[2]))
        return
    if args.serve and args.serve.startswith("nixl:"):
        _nixl.serve(int(args.serve.partition(":")[2]))
        return
    if args.serve and args.serve.startswith("nixl-sender:"):
        size, n = (int(v) for v in args.serve.split(":")[1:])
        print("times", json.dumps(_nixl.run(__file__, size, n, ENV)), flush=True)
        os._exit(0)  # nixl_cu12 1.5.1 crashes tearing its agents down at exit
    with ExitStack() as stack:
        receivers = Receivers(ENV, args.quick, ("ucx", "tcp"))
        stack.callback(receivers.close)
        raw = None
        if args.quick:
            # One raw-ucxx child for every size: its buffer takes the largest.
            child = _raw_ucxx_child(max(SIZES.values()))
            raw = stack.enter_context(_raw_ucxx.pinging(child, ENV))
        measure_and_report(args.quick, args.rounds, receivers, raw)


def measure_and_report(
    quick: bool, rounds_of_each: int, receivers: Receivers, raw: _raw_ucxx.RoundTrips | None
) -> None:
    counts = QUICK_ITERATIONS if quick else ITERATIONS
    nixl = _nixl.available()
    if not nixl:
        print("no nixl row: nixl_cu12 does not import (see bench/_nixl.py)", flush=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for size_name, n in counts.items():
        size = SIZES[size_name]
        print(f"[{size_name}] {n} hand-offs per path, {rounds_of_each} round(s) ...", flush=True)
        rounds = [
            {
                "memcpy": timed_row(memcpy_run(size_name, n), size),
                "ucx_perftest": perftest_row(size_name, n),
                "raw-ucxx": timed_row(raw_ucxx_run(size_name, n, raw), size),
                **({"nixl": timed_row(nixl_run(size, n), size)} if nixl else {}),
                "socket": timed_row(socket_run(size_name, n), size),
                "omnipipe-ucx": timed_row(omnipipe_run(receivers, "ucx", size, n), size),
                "omnipipe-tcp": timed_row(omnipipe_run(receivers, "tcp", size, n), size),
            }
            for _ in range(rounds_of_each)
        ]
        results[size_name] = {
            path: {key: median([r[path][key] for r in rounds]) for key in rounds[0][path]}
            for path in rounds[0]
        }
    rows = []
    for size_name, paths in results.items():
        for path, r in paths.items():
            anchor = {"omnipipe-ucx": "raw-ucxx", "omnipipe-tcp": "socket"}.get(path)
            ratio = f"{r['gbps'] / paths[anchor]['gbps']:.2g}x {anchor}" if anchor else ""
            rows.append(
                [
                    size_name,
                    path,
                    f"{r['gbps']:.3f}",
                    f"{r['p50_us']:.1f}",
                    "n/a" if r["p99_us"] != r["p99_us"] else f"{r['p99_us']:.1f}",
                    f"{r['gbps'] / paths['memcpy']['gbps']:.3f}",
                    ratio,
                ]
            )
    print()
    print(table(["size", "path", "GB/s", "p50 us", "p99 us", "vs memcpy", "GB/s vs anchor"], rows))
    print("(ucx_perftest p50 is 2x its tag_lat half-round-trip; its p99 is not reported)")
    kv_n = 5 if quick else 40
    print(f"[KV] {kv_n} hand-offs of {KV_BLOCKS} scattered {KV_BLOCK_BYTES // KIB} KiB blocks ...")
    kv_size = KV_BLOCKS * KV_BLOCK_BYTES
    kv = {
        f"{backend}-{shape}": timed_row(
            kv_run(receivers, backend, kv_n, shape == "blocks"), kv_size
        )
        for backend in ("ucx", "tcp")
        for shape in ("blocks", "contiguous")
    }
    print(
        table(
            ["KV 16 MiB", "GB/s", "p50 us", "blocks vs contiguous"],
            [
                [
                    path,
                    f"{r['gbps']:.3f}",
                    f"{r['p50_us']:.1f}",
                    f"{r['gbps'] / kv[path.replace('blocks', 'contiguous')]['gbps']:.2f}x",
                ]
                for path, r in kv.items()
            ],
        )
    )
    idle_n, idle_s = (5, QUICK_IDLE_SECONDS) if quick else (30, IDLE_SECONDS)
    idle = {backend: idle_run(receivers, backend, idle_n, idle_s) for backend in ("ucx", "tcp")}
    print(
        table(
            ["idle", "sender CPU", "receiver CPU", "4KiB hot p50 us", f"after {WAKE_GAP}s idle"],
            [
                [
                    b,
                    f"{r['sender_idle_cpu']:.1%}",
                    f"{r['receiver_idle_cpu']:.1%}",
                    f"{r['hot_p50_us']:.1f}",
                    f"{r['after_idle_p50_us']:.1f}",
                ]
                for b, r in idle.items()
            ],
        )
    )
    record("transfer", {**results, "kv-16MiB": kv, "idle": idle}, quick)
    summary = {
        f"{path.replace('omnipipe-', '')}_{size_name.lower()}_{key}": paths[path][key]
        for size_name, paths in results.items()
        for path in ("omnipipe-ucx", "omnipipe-tcp")
        for key in ("gbps", "p50_us")
    }
    summary |= {
        f"ucx_vs_{anchor.replace('-', '_').replace('omnipipe_', '')}_{s.lower()}": results[s][
            "omnipipe-ucx"
        ]["gbps"]
        / results[s][anchor]["gbps"]
        for s in results
        for anchor in ("raw-ucxx", "ucx_perftest", "omnipipe-tcp")
    }
    summary |= {
        f"tcp_vs_socket_{s.lower()}": results[s]["omnipipe-tcp"]["gbps"]
        / results[s]["socket"]["gbps"]
        for s in results
    }
    summary |= {f"kv_{path.replace('-', '_')}_gbps": r["gbps"] for path, r in kv.items()}
    summary |= {f"{b}_{k}": v for b, r in idle.items() for k, v in r.items()}
    print("transfer: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
