"""AsyncOmni: the asynchronous client, shaped like vLLM-Omni's `AsyncOmni`. It starts
the pipeline on this machine or attaches to a running router; its requests stream from
the router's /v1/omni/generate."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from omnipipe.client.control import ControlCalls, own_pipeline_file
from omnipipe.client.local_serve import exit_error, free_port, start_serve, stop_serve
from omnipipe.client.types import (
    DuplicateRequestId,
    Modality,
    OmniError,
    OmniRequestOutput,
    error_from,
    error_of,
    output_of,
)

Prompt = str | list[dict[str, Any]] | dict[str, Any]


def _prompt_fields(prompt: Prompt) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list):
        return {"messages": prompt}
    if isinstance(prompt, dict) and set(prompt) <= {"prompt", "messages", "negative_prompt"}:
        return dict(prompt)
    raise TypeError("prompt: a string, a list of chat messages, or {'prompt'|'messages': ...}")


class AsyncOmni(ControlCalls):
    def __init__(
        self,
        model: str | None = None,
        stage_configs_path: str | os.PathLike[str] | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        request_timeout: float = 600.0,
    ) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._pipeline_file: Path | None = None
        self._adapter_lock: asyncio.Lock | None = None
        self._model = model
        # Every request from generate()'s first step to its end, and the response of
        # those whose stream is open.
        self._running: set[str] = set()
        self._active: dict[str, httpx.Response] = {}
        self._aborted: set[str] = set()
        self._errored: OmniError | None = None
        self._closed = False
        if base_url is None:
            if stage_configs_path is None and model is None:
                raise ValueError("give model, stage_configs_path (a pipeline file) or base_url")
            # Its own file, which add_lora and remove_lora change and reload.
            self._pipeline_file, folder = own_pipeline_file(model, stage_configs_path)
            port = port or free_port(host)
            self._proc, log = start_serve(self._pipeline_file, host, port)
            self._log_path = Path(log.name)
            # The pipeline's processes never outlive this object, even if shutdown() is
            # never called.
            self._finalizer = weakref.finalize(self, stop_serve, self._proc, log, folder)
            base_url = f"http://{host}:{port}"
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=10.0),
        )

    # -- state ------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self._closed and self._errored is None and self._process_error() is None

    @property
    def errored(self) -> bool:
        return self._errored is not None or self._process_error() is not None

    def _process_error(self) -> OmniError | None:
        if self._proc is None or self._closed:
            return None
        return exit_error(self._proc, self._log_path)

    async def check_health(self) -> None:
        """Raises OmniError unless every stage has a ready replica."""
        if self._closed:
            raise OmniError("this AsyncOmni is shut down")
        if (error := self._process_error()) is not None:
            self._errored = error
            raise error
        try:
            resp = await self._http.get("/ready")
        except httpx.HTTPError as exc:
            raise OmniError(f"{self.base_url} is not reachable: {exc!r}") from exc
        if resp.status_code != 200:
            raise OmniError(f"{self.base_url} is not ready: {resp.text[:500]}", resp.status_code)

    async def wait_ready(self, seconds: float = 600.0) -> None:
        """Waits until the pipeline serves (a local one loads its models first)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                await self.check_health()
                break
            except OmniError:
                if self._errored is not None or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
        if self._model is None:
            models = (await self._http.get("/v1/models")).json()["data"]
            self._model = str(models[0]["id"])

    # -- requests ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        sampling_params_list: Sequence[dict[str, Any] | None] | dict[str, Any] | None = None,
        output_modalities: Sequence[Modality] | None = None,
        **params: Any,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Every emitting stage's outputs as they are made. `params` are the router's
        request fields: max_tokens, temperature, seed, voice; size, n,
        num_inference_steps, guidance_scale, negative_prompt, lora ({"name", "scale"}:
        a LoRA adapter of spec.adapters). A text-to-speech graph (Qwen3-TTS) reads the
        prompt aloud: voice (a preset or an uploaded voice), seed, max_tokens (its codes),
        and /v1/audio/speech's language, instructions, task_type, ref_audio,
        x_vector_only_mode, speed and initial_codec_chunk_frames.

        A request_id names one running request of this client: a second generate() with
        the id of one still running raises DuplicateRequestId (a ValueError) at its first
        step, and the first runs on; once it has ended, the id may be used again.
        abort(request_id) therefore always means exactly one request."""
        if self._model is None:
            await self.wait_ready()
        request_id = request_id or uuid.uuid4().hex
        # Checked and taken with no await between: two calls racing for one id cannot
        # both pass.
        if request_id in self._running:
            raise DuplicateRequestId(
                f"request_id {request_id!r} is already running on this client; wait for "
                "it to end or abort it, or use another id"
            )
        self._running.add(request_id)
        try:
            async for out in self._generate(
                request_id, prompt, sampling_params_list, output_modalities, params
            ):
                yield out
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    async def _generate(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params_list: Sequence[dict[str, Any] | None] | dict[str, Any] | None,
        output_modalities: Sequence[Modality] | None,
        params: dict[str, Any],
    ) -> AsyncIterator[OmniRequestOutput]:
        body = {
            "model": self._model,
            "request_id": request_id,
            **_prompt_fields(prompt),
            **params,
        }
        if sampling_params_list is not None:
            body["sampling_params_list"] = (
                list(sampling_params_list)
                if not isinstance(sampling_params_list, dict)
                else sampling_params_list
            )
        if output_modalities is not None:
            body["output_modalities"] = list(output_modalities)
        async with self._http.stream("POST", "/v1/omni/generate", json=body) as resp:
            if request_id in self._aborted:
                return  # aborted while the request was being sent
            self._active[request_id] = resp
            try:
                if resp.status_code != 200:
                    raise error_of(resp.status_code, await resp.aread())
                async for out in self._outputs(request_id, resp):
                    yield out
            except (httpx.StreamError, httpx.TransportError):
                if request_id in self._aborted:
                    return
                raise
            finally:
                self._active.pop(request_id, None)

    async def _outputs(
        self, request_id: str, resp: httpx.Response
    ) -> AsyncIterator[OmniRequestOutput]:
        parts: dict[tuple[str, int], dict[str, list[str]]] = {}
        kinds: dict[str, Modality] = {}
        async for line in resp.aiter_lines():
            if request_id in self._aborted:
                return  # lines read before the abort closed the stream
            if not line:
                continue
            event = json.loads(line)
            kind = event["type"]
            if kind == "part":
                pieces = parts.setdefault((event["stage"], event["index"]), {})
                pieces.setdefault(event["key"], []).append(event["text"])
            elif kind == "output":
                key = (event["stage"], event["index"])
                data = {k: "".join(v) for k, v in parts.pop(key, {}).items()} | event["data"]
                kinds[event["stage"]] = event["modality"]
                yield output_of(request_id, event["stage"], event["modality"], event["index"], data)
            elif kind == "finished":
                stage = event["stage"]
                yield OmniRequestOutput(request_id, stage, kinds.get(stage), finished=True)
            elif kind == "error":
                raise error_from(event["error"], 500)
            elif kind == "done":
                return
        if request_id not in self._aborted:
            raise OmniError(f"request {request_id}: the stream ended before it was done")

    async def abort(self, request_id: str) -> None:
        """Stops the running request of this id (there is at most one: see generate()):
        its stream ends, and every stage lets it go. One still being sent ends as soon
        as the router answers."""
        if request_id not in self._running:
            return
        self._aborted.add(request_id)
        resp = self._active.get(request_id)
        if resp is not None:
            await resp.aclose()

    # -- lifetime ---------------------------------------------------------------------

    async def shutdown(self) -> None:
        if self._closed:
            return
        for request_id in list(self._running):
            await self.abort(request_id)
        await self._http.aclose()
        self._closed = True
        if self._proc is not None:
            await asyncio.to_thread(self._finalizer)

    async def __aenter__(self) -> AsyncOmni:
        await self.wait_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
