"""A running stage's control calls, vLLM's AsyncOmni's per stage: pause and resume
generation, sleep and wake up, the torch profiler, the tokenizer and the engine's caches.
The router fans each out to every replica of a stage (router/api/admin.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import gc
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from omnipipe.api.param_limits import StageLimits
from omnipipe.stagekit.stage import Stage, StageInputError
from omnipipe.worker.profiler import ControlRefused, ProfileLimits, StageProfiler, resident_bytes
from omnipipe.worker.runtime import StageRuntime

__all__ = ["ControlRefused", "StageControl", "control_router"]

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait"]
ABORTED = "request aborted: generation paused"


class PauseBody(BaseModel):
    mode: PauseMode = "abort"
    """abort: end every request the stage holds (each client gets a 503); wait: let the
    admitted ones finish. Either way, requests that arrive wait for resume."""


class SleepBody(BaseModel):
    level: int = Field(default=1, ge=1, le=2)
    """1: the models go to host memory; 2: they are dropped, and reloaded on wake."""


class CacheBody(BaseModel):
    cache: Literal["prefix", "mm"]


class VoicePromptBody(BaseModel):
    clip: str = Field(max_length=16 << 20)  # base64: the router's 10 MiB clip and then some
    ref_text: str | None = Field(default=None, max_length=4096)


def _memory_bytes(device: torch.device) -> int:
    """What the stage's device holds: CUDA's allocated bytes, or this process's RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return resident_bytes()


def _give_back_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    # glibc keeps freed heap pages; trimming returns them, so RSS shows the release.
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS shows less
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _to_host(stage: Stage) -> tuple[int, list[tuple[torch.nn.Module, torch.device]]]:
    """Moves the stage's torch models to the CPU (on the engine thread): the bytes that
    left a device, and where each model was, for the wake."""
    moved, homes = 0, []
    for module in stage.torch_modules():
        tensors = [*module.parameters(), *module.buffers()]
        if not tensors:
            continue
        homes.append((module, tensors[0].device))
        moved += sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")
        module.to("cpu")
    return moved, homes


def _back_home(homes: list[tuple[torch.nn.Module, torch.device]]) -> None:
    for module, device in homes:
        module.to(device)


class StageControl:
    """Pause, sleep and the profiler of one worker's stage; one change at a time."""

    def __init__(
        self,
        stage: str,
        runtime: Callable[[], StageRuntime | None],
        reload: Callable[[], Awaitable[Stage]],
        settle_seconds: float,
        profile_dir: Path,
        profile_limits: ProfileLimits | None = None,
    ) -> None:
        self.stage = stage
        self._runtime = runtime
        self._reload = reload
        self._settle_seconds = settle_seconds
        self.profiler = StageProfiler(stage, profile_dir, profile_limits or ProfileLimits())
        self.paused: PauseMode | None = None
        self.sleep_level = 0
        self._lock = asyncio.Lock()
        self._waking: asyncio.Task[dict[str, Any]] | None = None
        self._homes: list[tuple[torch.nn.Module, torch.device]] = []  # level 1's

    def _loaded(self) -> StageRuntime:
        runtime = self._runtime()
        if runtime is None:
            raise LookupError(f"stage {self.stage} has not loaded its model yet")
        return runtime

    def state(self) -> dict[str, Any]:
        runtime = self._runtime()
        return {
            "stage": self.stage,
            "running": runtime.running if runtime else 0,
            "waiting": runtime.waiting if runtime else 0,
            "paused": self.paused is not None,
            "pause_mode": self.paused,
            "sleeping": self.sleep_level > 0,
            "sleep_level": self.sleep_level,
            "profiling": self.profiler.profiling,
        }

    async def _settled(self, runtime: StageRuntime, action: str) -> None:
        """Closes the gate and waits for the admitted requests to finish."""
        runtime.pause_admission()
        if not await runtime.wait_none_admitted(self._settle_seconds):
            self._reopen(runtime)
            raise ControlRefused(
                f"stage {self.stage}: {runtime.admitted} requests still running after "
                f"{self._settle_seconds:.0f}s, so it cannot {action} now; pause it "
                "(mode abort) first, or try again"
            )

    def _reopen(self, runtime: StageRuntime) -> None:
        if self.paused is None:
            runtime.resume_admission()

    # ---- pause -------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> dict[str, Any]:
        runtime = self._loaded()
        async with self._lock:
            self.paused = mode
            runtime.pause_admission()
            aborted = runtime.abort_all(ABORTED) if mode == "abort" else 0
            settled = await runtime.wait_none_admitted(self._settle_seconds)
        log.info("stage %s: generation paused (%s, %d aborted)", self.stage, mode, aborted)
        return {**self.state(), "aborted": aborted, "running": 0 if settled else runtime.admitted}

    async def resume(self) -> dict[str, Any]:
        runtime = self._loaded()
        async with self._lock:
            self.paused = None
            runtime.resume_admission()
        log.info("stage %s: generation resumed", self.stage)
        return self.state()

    # ---- sleep -------------------------------------------------------------------------
    async def sleep(self, level: int) -> dict[str, Any]:
        runtime = self._loaded()
        async with self._lock:
            if self.sleep_level:
                raise ControlRefused(
                    f"stage {self.stage} is asleep already (level {self.sleep_level}): "
                    "wake it up first"
                )
            stage = runtime.stage
            assert stage is not None
            if level == 2 and stage.kv_block_table() is not None:
                raise ControlRefused(
                    f"stage {self.stage} receives KV blocks into its model's table: it "
                    "sleeps at level 1 only"
                )
            if level == 1 and stage.device.type != "cpu" and not stage.torch_modules():
                raise ControlRefused(
                    f"stage {self.stage}'s model lives inside its engine (vLLM), which level "
                    "1 cannot move: sleep it at level 2"
                )
            await self._settled(runtime, f"sleep (level {level})")
            device = stage.device
            try:
                if level == 1:
                    # What left the device: nothing when the stage runs on the CPU.
                    released, self._homes = await runtime.between_batches(_to_host, stage)
                else:
                    before = _memory_bytes(device)
                    await runtime.unload()
                # Asleep from here: whatever fails next, a request wakes the stage.
                self.sleep_level = level
                runtime.set_before_work(self.wake_for_request)
                del stage
                # On the engine thread, after what it still holds of the stage (a
                # session's close) has run.
                await runtime.between_batches(_give_back_memory, device)
                if level == 2:
                    released = max(0, before - _memory_bytes(device))
            finally:
                self._reopen(runtime)
        log.info("stage %s: asleep (level %d), %d bytes released", self.stage, level, released)
        return {**self.state(), "device": device.type, "released_bytes": released}

    async def wake_up(self) -> dict[str, Any]:
        runtime = self._loaded()
        async with self._lock:
            if self.sleep_level == 1:
                await runtime.between_batches(_back_home, self._homes)
                self._homes = []
            elif self.sleep_level == 2:
                runtime.load(await self._reload())
            woke, self.sleep_level = self.sleep_level, 0
            runtime.set_before_work(None)
        if woke:
            log.info("stage %s: awake (from level %d)", self.stage, woke)
        return self.state()

    async def wake_for_request(self) -> None:
        """One wake for every request that finds the stage asleep, shielded: a request
        that gives up (a timeout, a client gone) leaves the reload running for the rest."""
        if not self.sleep_level:
            return
        if self._waking is None or self._waking.done():
            log.info("stage %s: a request wakes it", self.stage)
            self._waking = asyncio.create_task(self.wake_up())
        await asyncio.shield(self._waking)

    # ---- the profiler ------------------------------------------------------------------
    async def start_profile(self) -> dict[str, Any]:
        await self.profiler.start(self._loaded())
        return self.state()

    async def stop_profile(self) -> dict[str, Any]:
        return {**self.state(), **await self.profiler.stop(self._loaded())}

    # ---- the tokenizer and the caches --------------------------------------------------
    async def limits(self) -> dict[str, Any]:
        """The bounds the loaded model puts on request parameters, for the router."""
        runtime = self._loaded()
        return StageLimits(stage=self.stage, limits=runtime.param_limits).model_dump()

    async def preset_voices(self) -> list[str]:
        """The loaded model's voices by name; a stage asleep at level 2 cannot say."""
        stage = self._loaded().stage
        if stage is None:
            raise ControlRefused(f"stage {self.stage} is asleep: its voices are not loaded")
        return list(stage.preset_voices())

    async def voice_prompt(self, clip: str, ref_text: str | None) -> dict[str, Any]:
        """An uploaded voice's prompt, made on the engine thread between batches (an
        upload is rare, and the encoders are the model's)."""
        runtime = self._loaded()
        stage = runtime.stage
        if stage is None:
            raise ControlRefused(f"stage {self.stage} is asleep: its encoders are not loaded")
        if type(stage).voice_prompt is Stage.voice_prompt:
            raise ControlRefused(f"stage {self.stage} clones no voice")
        try:
            prompt: dict[str, Any] = await runtime.between_batches(
                stage.voice_prompt, clip, ref_text
            )
        except NotImplementedError as exc:
            raise ControlRefused(f"stage {self.stage}: {exc}") from None
        return prompt

    async def tokenizer_files(self) -> dict[str, str]:
        """The tokenizer, as save_pretrained writes it: file name -> base64 content."""
        runtime = self._loaded()
        stage = runtime.stage
        if stage is None:  # asleep at level 2
            await self.wake_up()
            stage = runtime.stage
        tokenizer = stage.text_tokenizer() if stage is not None else None
        if tokenizer is None:
            raise ControlRefused(f"stage {self.stage} has no tokenizer")

        def saved() -> dict[str, str]:  # on the preparer, the tokenizer's one other user
            with tempfile.TemporaryDirectory() as folder:
                tokenizer.save_pretrained(folder)
                return {
                    path.name: base64.b64encode(path.read_bytes()).decode()
                    for path in sorted(Path(folder).iterdir())
                    if path.is_file()
                }

        return await runtime.beside_engine(saved)

    async def reset_cache(self, cache: str) -> dict[str, Any]:
        runtime = self._loaded()
        async with self._lock:
            stage = runtime.stage
            if stage is None:
                raise ControlRefused(
                    f"stage {self.stage} is asleep (level 2): its engine, caches included, "
                    "is gone until it wakes"
                )
            if type(stage).reset_cache is Stage.reset_cache:
                raise ControlRefused(f"stage {self.stage} keeps no {cache} cache")
            await self._settled(runtime, f"reset its {cache} cache")
            try:
                await runtime.between_batches(stage.reset_cache, cache)
            except (NotImplementedError, RuntimeError) as exc:
                raise ControlRefused(f"stage {self.stage}: {exc}") from None
            finally:
                self._reopen(runtime)
        log.info("stage %s: %s cache reset", self.stage, cache)
        return {**self.state(), "reset": cache}


def control_router(control: StageControl) -> APIRouter:
    router = APIRouter(prefix="/control")

    async def answer(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except LookupError as exc:
            raise HTTPException(503, detail=str(exc)) from None
        except ControlRefused as exc:
            raise HTTPException(409, detail=str(exc)) from None
        except StageInputError as exc:
            raise HTTPException(400, detail=exc.message) from None

    @router.get("")
    async def state() -> dict[str, Any]:
        return control.state()

    @router.post("/pause")
    async def pause(body: PauseBody) -> dict[str, Any]:
        return await answer(control.pause(body.mode))  # type: ignore[no-any-return]

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        return await answer(control.resume())  # type: ignore[no-any-return]

    @router.post("/sleep")
    async def sleep(body: SleepBody) -> dict[str, Any]:
        return await answer(control.sleep(body.level))  # type: ignore[no-any-return]

    @router.post("/wake_up")
    async def wake_up() -> dict[str, Any]:
        return await answer(control.wake_up())  # type: ignore[no-any-return]

    @router.post("/profile/start")
    async def start_profile() -> dict[str, Any]:
        return await answer(control.start_profile())  # type: ignore[no-any-return]

    @router.post("/profile/stop")
    async def stop_profile() -> dict[str, Any]:
        return await answer(control.stop_profile())  # type: ignore[no-any-return]

    @router.get("/limits")
    async def limits() -> dict[str, Any]:
        return await answer(control.limits())  # type: ignore[no-any-return]

    @router.get("/voices")
    async def voices() -> dict[str, Any]:
        return {"stage": control.stage, "voices": await answer(control.preset_voices())}

    @router.post("/voice_prompt")
    async def voice_prompt(body: VoicePromptBody) -> dict[str, Any]:
        prompt = await answer(control.voice_prompt(body.clip, body.ref_text))
        return {"stage": control.stage, "prompt": prompt}

    @router.get("/tokenizer")
    async def tokenizer() -> dict[str, Any]:
        files = await answer(control.tokenizer_files())
        return {"stage": control.stage, "files": files}

    @router.post("/reset_cache")
    async def reset_cache(body: CacheBody) -> dict[str, Any]:
        return await answer(control.reset_cache(body.cache))  # type: ignore[no-any-return]

    return router
