"""A running stage's torch profiler, bounded. The profiler keeps every event it records in
host memory until it stops: left running under traffic it grew a worker by 1.6 GB in
10 s. So a profile stops by itself after `max_seconds`, or once the process has grown by
`max_bytes` since it started, whichever comes first; its trace is written then, and the
next stop call answers it with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnipipe.worker.runtime import StageRuntime

log = logging.getLogger(__name__)
WATCH_EVERY_SECONDS = 0.25


class ControlRefused(Exception):
    """The stage cannot do this now, or at all: the reason goes to the caller (409)."""


@dataclass(frozen=True)
class ProfileLimits:
    max_seconds: float = 60.0
    max_bytes: int = 512 << 20


def resident_bytes() -> int:
    """This process's RSS: where the profiler keeps its events, whatever the device."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StageProfiler:
    def __init__(self, stage: str, folder: Path, limits: ProfileLimits) -> None:
        self.stage = stage
        self.folder = folder
        self.limits = limits
        self._profiler: torch.profiler.profile | None = None
        self._since = 0.0
        self._watcher: asyncio.Task[None] | None = None
        # A profile that stopped by itself, until a stop call collects it.
        self._unclaimed: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    @property
    def profiling(self) -> bool:
        return self._profiler is not None

    async def start(self, runtime: StageRuntime) -> None:
        async with self._lock:
            if self._profiler is not None:
                raise ControlRefused(f"stage {self.stage} is profiling already")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            base = resident_bytes()
            # Started on the engine thread, whose work the trace records.
            await runtime.between_batches(profiler.start)
            self._profiler, self._since, self._unclaimed = profiler, time.time(), None
            self._watcher = asyncio.create_task(self._watch(runtime, base))

    async def stop(self, runtime: StageRuntime) -> dict[str, Any]:
        """The trace of the profile this call stops, or of the one that stopped by itself."""
        async with self._lock:
            if self._profiler is None:
                if self._unclaimed is None:
                    raise ControlRefused(
                        f"stage {self.stage} is not profiling: start_profile first"
                    )
                done, self._unclaimed = self._unclaimed, None
                return done
            if self._watcher is not None:
                self._watcher.cancel()
            return await self._finish(runtime, "stop_profile")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch(self, runtime: StageRuntime, base: int) -> None:
        limits = self.limits
        while True:
            await asyncio.sleep(WATCH_EVERY_SECONDS)
            if time.time() - self._since >= limits.max_seconds:
                reason = f"its time limit ({limits.max_seconds:g} s)"
            elif resident_bytes() - base >= limits.max_bytes:
                reason = f"its memory limit ({limits.max_bytes >> 20} MiB of growth)"
            else:
                continue
            async with self._lock:
                if self._profiler is not None:
                    self._unclaimed = await self._finish(runtime, reason)
                    log.warning("stage %s: the profile reached %s", self.stage, reason)
            return

    async def _finish(self, runtime: StageRuntime, reason: str) -> dict[str, Any]:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        await runtime.between_batches(profiler.stop)
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._since))
        trace = self.folder / f"{self.stage}-{socket.gethostname()}-{os.getpid()}-{stamp}.json"
        await asyncio.to_thread(profiler.export_chrome_trace, str(trace))
        log.info("stage %s: profile written to %s", self.stage, trace)
        return {"trace": str(trace), "stopped_by": reason}
