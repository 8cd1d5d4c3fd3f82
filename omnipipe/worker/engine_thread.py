"""The stage's engine thread, the preparation thread beside it, and the threads that
prepare requests (decode their media).

Every engine call runs on the one engine thread, so the event loop keeps serving
transfers and health checks meanwhile; the watchdog reads how long the call now running
has gone without progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from omnipipe.worker.threads import set_thread_team

T = TypeVar("T")
# Requests preparing at once: a long decode (a large clip, within its limits) holds one
# thread, and the requests after it prepare on the others instead of queueing behind it.
PREPARE_THREADS = 4


class EngineThread:
    def __init__(self, threads: int | None = None) -> None:
        # A colocated stage's threads take its share of the process's cores (threads);
        # alone in its process, the process-wide budget already fits it.
        team = (set_thread_team, (threads,)) if threads is not None else (None, ())
        self._engine = ThreadPoolExecutor(1, "engine", *team)
        # The one thread beside the engine that may use the stage's processors: their
        # tokenizers are not safe to share between threads.
        self._preparer = ThreadPoolExecutor(1, "beside", *team)
        self._decoders = ThreadPoolExecutor(PREPARE_THREADS, "prepare", *team)
        # The watchdog's view of the engine thread: when the call now running last made
        # progress (None: the thread is idle). Written on that thread, read on the loop.
        self._progress_at: float | None = None

    def progress(self) -> None:
        """Called from the engine thread between units of work (a denoising step)."""
        self._progress_at = time.monotonic()

    def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs on the engine thread: fn, with the watchdog's clock running while it does."""
        self._progress_at = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._progress_at = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the engine thread, after what it runs now."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._engine, self._on_engine, fn, *args)

    def run_later(self, fn: Callable[[], object]) -> None:
        """Queues fn on the engine thread, after what it runs now, without waiting for it:
        it never runs beside an engine call."""
        self._engine.submit(fn)

    async def beside(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the preparation thread, the one other thread that uses the stage's
        processors (their tokenizers are not safe to share between threads)."""
        return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, *args)

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn, a request's preparation (StreamingStage.prepare: decoding its media,
        no tokenizer), on one of the preparing threads, beside other requests'."""
        return await asyncio.get_running_loop().run_in_executor(self._decoders, fn, *args)

    def seconds_without_progress(self) -> float:
        """How long the engine call now running has gone without progress; 0 when idle."""
        since = self._progress_at
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def shutdown(self) -> None:
        self._engine.shutdown(wait=False, cancel_futures=True)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._decoders.shutdown(wait=False, cancel_futures=True)
