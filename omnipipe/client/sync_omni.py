"""Omni: the synchronous client, shaped like vLLM-Omni's `Omni`: whole results, with an
AsyncOmni running on an event loop of its own."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from omnipipe.client.async_omni import AsyncOmni, Prompt
from omnipipe.client.types import Modality, OmniResult
from omnipipe.router.api.audio import wav_bytes

T = TypeVar("T")


class Omni:
    """The synchronous form: Omni(...).generate([...]) returns every request's whole
    result. It runs an AsyncOmni on an event loop of its own."""

    def __init__(self, *args: Any, ready_timeout: float = 600.0, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> AsyncOmni:
            return AsyncOmni(*args, **kwargs)

        self._omni = self._run(make())
        try:
            self._run(self._omni.wait_ready(ready_timeout))
        except BaseException:
            self.shutdown()
            raise

    def _run(self, work: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params_list: Sequence[dict[str, Any] | None] | dict[str, Any] | None = None,
        output_modalities: Sequence[Modality] | None = None,
        **params: Any,
    ) -> list[OmniResult]:
        """One result per prompt, the prompts run concurrently. A list of chat messages
        is one prompt; pass [messages] for it in a batch."""
        batch: list[Prompt] = (
            list(prompts)
            if isinstance(prompts, list) and prompts and not _is_message(prompts[0])
            else [prompts]  # type: ignore[list-item]
        )

        async def one(prompt: Prompt) -> OmniResult:
            result = OmniResult(request_id=uuid.uuid4().hex)
            pcm, rate = bytearray(), 0
            async for out in self._omni.generate(
                prompt, result.request_id, sampling_params_list, output_modalities, **params
            ):
                result.outputs.append(out)
                result.text += out.text
                pcm += out.audio
                rate = out.sample_rate or rate
                if out.image:
                    result.images.append(out.image)
            if pcm:
                result.audio_wav = wav_bytes(bytes(pcm), rate)
            return result

        async def every() -> list[OmniResult]:
            return list(await asyncio.gather(*(one(p) for p in batch)))

        return self._run(every())

    def check_health(self) -> None:
        self._run(self._omni.check_health())

    @property
    def is_running(self) -> bool:
        return self._omni.is_running

    def shutdown(self) -> None:
        if self._loop.is_running():
            if hasattr(self, "_omni"):
                self._run(self._omni.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _is_message(item: object) -> bool:
    return isinstance(item, dict) and "role" in item
