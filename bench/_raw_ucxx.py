"""ucxx's low-level API with nothing of ours (the transfer benchmarks' anchor): worker
addresses swapped over the child's stdin/stdout, then a busy-polling ping-pong of one
preallocated buffer one way and 8 bytes back."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _procs import answering_child

# round_trips(data, n, warmup): n timed round trips of `data` after `warmup` untimed ones.
RoundTrips = Callable[[Any, int, int], list[float]]


def worker() -> tuple[Any, Any]:
    """(the libucxx module, a worker of a fresh tag-matching context)."""
    import ucxx._lib.libucxx as lib

    context = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
    return lib, lib.UCXWorker(context)


def wait(ucx_worker: Any, requests: list[Any]) -> None:
    """Progresses the worker until every request completes, then raises their errors."""
    while not all(r.completed for r in requests):
        ucx_worker.progress()
    for r in requests:
        r.check_error()


def serve(buffer: Any) -> None:
    """The receiving child: each round receives into `buffer` (host or device memory),
    then answers 8 bytes."""
    import numpy as np
    from ucxx._lib.arr import Array

    lib, w = worker()
    print(w.address.tobytes().hex(), flush=True)
    peer = lib.UCXAddress.create_from_buffer(bytes.fromhex(sys.stdin.readline()))
    ep = lib.UCXEndpoint.create_from_worker_address(w, peer, False)
    buf, ack = Array(buffer), Array(np.zeros(8, dtype=np.uint8))
    while True:
        wait(w, [ep.tag_recv(buf, lib.UCXXTag(1))])
        wait(w, [ep.tag_send(ack, lib.UCXXTag(2))])


def ping(argv: list[str], env: dict[str, str], data: Any, n: int, warmup: int) -> list[float]:
    """Starts the child `argv` (which runs serve()), then times n round trips of `data`
    after `warmup` untimed ones."""
    with pinging(argv, env) as round_trips:
        return round_trips(data, n, warmup)


@contextmanager
def pinging(argv: list[str], env: dict[str, str]) -> Iterator[RoundTrips]:
    """The child `argv` (which runs serve()) connected; round_trips(data, n, warmup) times
    n round trips of `data` after `warmup` untimed ones, as often as called (data no
    larger than the child's buffer)."""
    import numpy as np
    from ucxx._lib.arr import Array

    proc, line = answering_child(argv, env)
    try:
        assert proc.stdin is not None
        lib, w = worker()
        peer = lib.UCXAddress.create_from_buffer(bytes.fromhex(line))
        proc.stdin.write(w.address.tobytes().hex() + "\n")
        proc.stdin.flush()
        ep = lib.UCXEndpoint.create_from_worker_address(w, peer, False)
        ack = Array(np.empty(8, dtype=np.uint8))

        def round_trips(data: Any, n: int, warmup: int) -> list[float]:
            payload = Array(data)
            times = []
            for _ in range(n + warmup):
                started = time.perf_counter()
                reply = ep.tag_recv(ack, lib.UCXXTag(2))
                wait(w, [ep.tag_send(payload, lib.UCXXTag(1)), reply])
                times.append(time.perf_counter() - started)
            return times[warmup:]

        yield round_trips
    finally:
        proc.kill()
        proc.wait(timeout=30)
