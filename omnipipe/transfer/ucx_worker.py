"""One UCX worker per process and event loop, driven by ucxx's low-level API (the C++
`UCXWorker`, no ucxx progress thread, no Python futures): whoever waits on a UCX request
progresses the worker itself, so a completion is seen on the next poll rather than after
a hop through another thread and the event loop.

Incoming work is handled where it is seen: a receiver registers a poller that runs after
every progress of the worker (from the event-fd callback, or inside another wait's poll),
so a small message is taken, put in the mailbox and acknowledged without waking a task.

A wait for a transfer in flight polls the worker in a tight loop (the event loop is not
entered: a 4 KiB round trip is a few µs of UCX) for `SPIN_SECONDS`, then arms the worker
and sleeps on its event file descriptor, watched by asyncio's selector for the worker's
life. A receiver polls (from the event loop, between other callbacks) for SPIN_SECONDS
after each message it takes and while its data lands. Every poll yields the CPU: the
kernel often wakes a peer on the polling core, which a poll that never yields keeps off
it for a whole time slice. Nothing polls while nothing is in flight, so an idle process
burns no core.

Large receive buffers come from a pool and return to it when the tensors built on them
are freed: a reused buffer is already mapped and registered in UCX's cache, where a fresh
one costs page faults that take as long as the copy itself. They start on a 2 MiB
boundary, in transparent huge pages (numpy asks for them): CMA, which moves the bytes
between two processes on one host, copies 64 MiB into such a buffer from a sender's
huge pages at the speed of memcpy, and at a third of it into an unaligned one
(bench/results/transfer-2026-11-23-round3.md)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# A wait for a transfer in flight polls for this long, then sleeps on the event fd.
# 1 ms beat 50 µs and 5 ms at every size on a 2-core machine, where a polling process
# takes the CPU its peer needs to answer (bench/results/transfer-2026-11-23-round3.md).
SPIN_SECONDS = float(os.environ.get("OMNIPIPE_UCX_SPIN_US", "1000")) * 1e-6
# Sleepers re-check at least this often, should an event ever be missed.
SLEEP_SECONDS = 0.1
# Buffers below this are cheap to allocate; the pool keeps at most POOL_BYTES.
POOL_MIN = 1 << 20
POOL_BYTES = 1 << 30
HUGE_PAGE = 2 << 20


@functools.cache
def _lib() -> Any:
    import ucxx._lib.libucxx as libucxx

    return libucxx


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def array(buffer: Any) -> Any:
    """ucxx's buffer wrapper for a numpy array or anything with the buffer protocol."""
    return _array_type()(buffer)


@functools.cache
def _array_type() -> Any:
    from ucxx._lib.arr import Array

    return Array


class PeerGone(ConnectionError):
    """The other end of a transfer connection went away."""


def aligned_buffer(nbytes: int) -> Any:
    """`nbytes` starting on a huge-page boundary (the array's base keeps the rest)."""
    raw = np.empty(nbytes + HUGE_PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes]


class BufferPool:
    """Receive buffers by exact size; a buffer comes back when nothing references the
    view handed out (the tensors built on it are gone)."""

    def __init__(self, max_bytes: int = POOL_BYTES) -> None:
        self._free: dict[int, list[Any]] = {}
        self._held = 0
        self._max = max_bytes

    def take(self, nbytes: int) -> Any:
        if nbytes < POOL_MIN:
            return np.empty(nbytes, dtype=np.uint8)
        free = self._free.get(nbytes)
        if free:
            slab = free.pop()
            self._held -= nbytes
        else:
            slab = aligned_buffer(nbytes)
        view = slab.view()
        weakref.finalize(view, self._give_back, slab)
        return view

    def _give_back(self, slab: Any) -> None:
        if self._held + slab.nbytes <= self._max:
            self._free.setdefault(slab.nbytes, []).append(slab)
            self._held += slab.nbytes

    @property
    def held_bytes(self) -> int:
        return self._held


class UcxWorker:
    """The process's UCX context and worker for one event loop (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        lib = _lib()
        self.loop = loop
        self.context = lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
        self.worker = lib.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()
        self.pool = BufferPool()
        # CUDA tensors move from and into device memory (UCX built with CUDA, and a GPU).
        self.device_memory = bool(self.context.cuda_support) and _cuda_available()
        self._fd: int = self.worker.epoll_file_descriptor
        self._sleepers: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._pollers: list[Callable[[], None]] = []
        self._ticker: asyncio.TimerHandle | None = None
        self._spinning = False
        self._poll_until = 0.0
        self.users = 0
        self._receivers = 0

    def next_receiver_index(self) -> int:
        self._receivers = (self._receivers + 1) & 0xFFFF
        return self._receivers

    # ---- endpoints and requests ------------------------------------------------------

    def endpoint(self, worker_address: bytes) -> Any:
        lib = _lib()
        address = lib.UCXAddress.create_from_buffer(worker_address)
        # Error handling off: UCX then picks CMA/shared memory on one host (on, it is
        # restricted to TCP). Peer death is seen on the rendezvous socket instead.
        return lib.UCXEndpoint.create_from_worker_address(self.worker, address, False)

    @staticmethod
    def tag(value: int) -> Any:
        return _lib().UCXXTag(value)

    @staticmethod
    def mask(value: int) -> Any:
        return _lib().UCXXTagMask(value)

    def probe(self, tag: Any, mask: Any) -> Any | None:
        """A queued message under `tag`/`mask` (made by tag() and mask()), taken off the
        queue (receive it with recv_probed), or None."""
        result = self.worker.tag_probe(tag, mask, remove=True)
        return result if result.matched else None

    def recv_probed(self, buffer: Any, probed: Any) -> Any:
        return self.worker.tag_recv_with_handle(array(buffer), probed)

    # ---- waiting ---------------------------------------------------------------------

    def add_poller(self, poller: Callable[[], None]) -> None:
        """`poller` runs after every progress of the worker, until removed: it takes
        what has arrived (it must not progress the worker itself)."""
        self._pollers.append(poller)

    def remove_poller(self, poller: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._pollers.remove(poller)

    def keep_polling(self) -> None:
        """Polls the worker from the event loop (between other callbacks, so nothing
        waits on it) for the next SPIN_SECONDS, extending a poll already running: a
        receiver whose data is in flight sees each step of the rendezvous at once
        rather than on the event fd (UCX's CUDA copies raise no event at all)."""
        self._poll_until = time.perf_counter() + SPIN_SECONDS
        if not self._spinning:
            self._spinning = True
            self.loop.call_soon(self._spin)

    def _spin(self) -> None:
        try:
            self.poll()
            os.sched_yield()  # see the module doc
        finally:
            if time.perf_counter() < self._poll_until:
                self.loop.call_soon(self._spin)
            else:
                self._spinning = False

    def poll(self) -> None:
        self.worker.progress()
        if self._pollers:
            for poller in tuple(self._pollers):  # a poller may remove itself
                poller()
        if self._sleepers:
            self._wake_ready()

    async def until(self, ready: Callable[[], bool], alive: Callable[[], bool]) -> None:
        """Returns once ready() holds; raises PeerGone once alive() does not. Polls for
        SPIN_SECONDS without entering the event loop, then sleeps until the worker's
        event fd (or a liveness change) wakes it."""
        spin_until = time.perf_counter() + SPIN_SECONDS
        while True:
            self.poll()
            if ready():
                return
            if not alive():
                raise PeerGone("the peer closed the transfer connection")
            if time.perf_counter() >= spin_until:
                await self._sleep(lambda: ready() or not alive())
                spin_until = time.perf_counter() + SPIN_SECONDS
            else:
                # A hand-off after idle took half as long with it on the 2-core VM, and
                # back to back no longer (bench/results/transfer-2026-11-23-round4.md).
                os.sched_yield()

    async def _sleep(self, wake: Callable[[], bool]) -> None:
        future: asyncio.Future[None] = self.loop.create_future()
        entry = (wake, future)
        self._sleepers.append(entry)
        timer = self.loop.call_later(SLEEP_SECONDS, _settle, future)
        try:
            self._arm()
            await future
        finally:
            timer.cancel()
            self._sleepers.remove(entry)

    def _arm(self) -> None:
        # arm() fails while events are pending: progress them first, then try again.
        for _ in range(100):
            self.poll()
            if self.worker.arm():
                return

    def _on_event(self) -> None:
        self._arm()

    def start_reading(self) -> None:
        """The event fd stays watched for the worker's life: an event runs the pollers,
        wakes the sleepers it concerns, and arms the worker again (else the fd stays
        readable)."""
        self.loop.add_reader(self._fd, self._on_event)
        self._tick()

    def _tick(self) -> None:
        # Should an event ever be missed, pollers still see arrivals within SLEEP_SECONDS
        # (about 10 µs of CPU per tick: nothing next to a core).
        self._arm()
        self._ticker = self.loop.call_later(SLEEP_SECONDS, self._tick)

    def stop_reading(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self.loop.remove_reader(self._fd)

    def _wake_ready(self) -> None:
        for wake, future in self._sleepers:
            if not future.done() and wake():
                future.set_result(None)

    def wake_sleepers(self) -> None:
        """A liveness flag changed outside UCX (a socket closed): re-check sleepers."""
        self._wake_ready()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_workers: dict[asyncio.AbstractEventLoop, UcxWorker] = {}


def acquire() -> UcxWorker:
    loop = asyncio.get_running_loop()
    worker = _workers.get(loop)
    if worker is None:
        worker = _workers[loop] = UcxWorker(loop)
        worker.start_reading()
    worker.users += 1
    return worker


def release(worker: UcxWorker) -> None:
    worker.users -= 1
    if worker.users == 0 and _workers.get(worker.loop) is worker:
        del _workers[worker.loop]
        with contextlib.suppress(Exception):
            worker.stop_reading()
        with contextlib.suppress(Exception):
            worker.worker.cancel_inflight_requests()


def active_workers() -> int:
    return len(_workers)


def ucx_errors() -> tuple[type[BaseException], ...]:
    lib = _lib()
    return (lib.UCXError, lib.UCXCanceledError)
