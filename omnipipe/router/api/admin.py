"""The admin API: vLLM AsyncOmni's control calls (pause, sleep, the profiler, the caches,
the tokenizer, LoRA adapters), each sent to every replica of the stages it names, or of
all stages. Guarded by the API key like /v1 (GuardMiddleware)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.router.api.common import stage_with_role
from omnipipe.router.errors import BadRequest, Conflict, StageUnavailable
from omnipipe.router.replicas import ReplicaPool
from omnipipe.router.voice_store import ClipRefused

# Waking a stage from sleep level 2 reloads its model: minutes on a real one.
CONTROL_TIMEOUT_SECONDS = 900.0
# A read (a replica's state, its tokenizer) answers at once or is stuck: one stuck
# replica is reported as such, and never holds the answer about the others.
READ_TIMEOUT_SECONDS = 5.0
# Encoding a voice's clip (up to a minute) between two of the talker's batches.
VOICE_PROMPT_TIMEOUT_SECONDS = 60.0

# Admin action -> the worker's control call (path, body fields taken from the request).
ACTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "pause": ("/control/pause", {}),
    "resume": ("/control/resume", {}),
    "sleep": ("/control/sleep", {}),
    "wake_up": ("/control/wake_up", {}),
    "start_profile": ("/control/profile/start", {}),
    "stop_profile": ("/control/profile/stop", {}),
    "reset_prefix_cache": ("/control/reset_cache", {"cache": "prefix"}),
    "reset_mm_cache": ("/control/reset_cache", {"cache": "mm"}),
}
Action = Literal[
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "start_profile",
    "stop_profile",
    "reset_prefix_cache",
    "reset_mm_cache",
]


class AdminCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stages: list[str] | None = Field(default=None, min_length=1, max_length=64)
    """The stages to act on; all of the pipeline's when left out (then a stage that
    cannot do it is skipped, and named in the answer)."""
    mode: Literal["abort", "wait"] = "abort"
    """pause: abort the requests in flight, or wait for them to finish."""
    level: int = Field(default=1, ge=1, le=2)
    """sleep: 1 moves the models to host memory, 2 drops them until wake_up."""


def _worker_body(action: str, call: AdminCall) -> dict[str, Any]:
    body = dict(ACTIONS[action][1])
    if action == "pause":
        body["mode"] = call.mode
    elif action == "sleep":
        body["level"] = call.level
    return body


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except ValueError:
        detail = None
    return str(detail) if detail else resp.text[:300]


class AdminService:
    def __init__(
        self,
        pipeline: Callable[[], ResolvedPipeline],
        pool: ReplicaPool,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        local: bool,
    ) -> None:
        self._pipeline = pipeline
        self._pool = pool
        self._client = client
        self._headers = headers
        self.local = local

    def _stages(self, named: list[str] | None) -> list[str]:
        known = [s.name for s in self._pipeline().stages]
        if named is None:
            return known
        for i, name in enumerate(named):
            if name not in known:
                raise BadRequest(
                    f"stages[{i}]: no stage {shown(name)}; the pipeline's: {', '.join(known)}",
                    param=f"stages[{i}]",
                )
        return list(dict.fromkeys(named))

    async def _call(
        self,
        method: str,
        url: str,
        path: str,
        body: dict[str, Any] | None,
        limit_s: float | None = None,
    ) -> tuple[int, Any]:
        limit = limit_s or (READ_TIMEOUT_SECONDS if method == "GET" else CONTROL_TIMEOUT_SECONDS)
        try:
            resp = await self._client.request(
                method, f"{url}{path}", json=body, headers=self._headers, timeout=limit
            )
        except httpx.TimeoutException:
            return 0, f"no answer within {limit:g} s"
        except httpx.HTTPError as exc:
            return 0, f"no answer: {exc!r}"
        if resp.status_code == 200:
            return 200, resp.json()
        return resp.status_code, _detail(resp)

    async def act(self, action: str, call: AdminCall) -> dict[str, Any]:
        stages = self._stages(call.stages)
        path, body = ACTIONS[action][0], _worker_body(action, call)
        # Ready replicas only: one still loading starts as every new worker does
        # (unpaused, awake), and a replica that is gone would fail the call.
        calls = [(s, url) for s in stages for url in self._pool.urls(s, ready_only=True)]
        answers = await asyncio.gather(*(self._call("POST", u, path, body) for _, u in calls))
        done: dict[str, list[dict[str, Any]]] = {stage: [] for stage in stages}
        refused: dict[str, list[str]] = {}
        failed: list[str] = []
        for (stage, url), (status, answer) in zip(calls, answers, strict=True):
            if status == 200:
                done[stage].append({"replica": url, **answer})
            elif status == 409:
                refused.setdefault(stage, []).append(str(answer))
            else:
                failed.append(f"stage {stage} replica {url}: {answer}")
        if failed:
            did_it = sum(len(answers) for answers in done.values())
            raise StageUnavailable(
                f"{action}: " + "; ".join(failed) + f" ({did_it} other replicas did it)",
                code="stage_unavailable",
            )
        # A stage every replica refused is skipped when the call named no stage; a stage
        # some replicas refused (one still busy, say) is not done, and that is a 409.
        skipped = {s: reasons[0] for s, reasons in refused.items() if not done[s]}
        partly = {s: reasons for s, reasons in refused.items() if done[s]}
        if partly or (skipped and (call.stages is not None or not any(done.values()))):
            reasons = [r for rs in refused.values() for r in rs]
            raise Conflict(f"{action}: " + "; ".join(dict.fromkeys(reasons)), code="not_done")
        for stage in skipped:
            del done[stage]
        return {"action": action, "stages": done, "skipped": skipped}

    async def states(self) -> dict[str, Any]:
        stages = self._stages(None)
        calls = [(stage, url) for stage in stages for url in self._pool.urls(stage)]
        answers = await asyncio.gather(*(self._call("GET", u, "/control", None) for _, u in calls))
        out: dict[str, list[dict[str, Any]]] = {stage: [] for stage in stages}
        for (stage, url), (status, answer) in zip(calls, answers, strict=True):
            entry = answer if status == 200 else {"error": answer, "status": status}
            out[stage].append({"replica": url, **entry})
        return {"stages": out}

    async def tokenizer(self, stage: str | None) -> dict[str, Any]:
        stages = self._stages(None if stage is None else [stage])
        refusals: list[str] = []
        for name in stages:
            for url in self._pool.urls(name, ready_only=True):
                status, answer = await self._call("GET", url, "/control/tokenizer", None)
                if status == 200:
                    return dict(answer)
                if status == 409:
                    refusals.append(str(answer))
                    break  # every replica of a stage runs the same model
        if len(refusals) < len(stages):
            raise StageUnavailable("no ready replica gave its tokenizer; try again")
        raise Conflict("no stage has a tokenizer: " + "; ".join(refusals), code="unsupported")

    async def preset_voices(self) -> list[str]:
        """Every stage's preset voices (one ready replica asked per stage: its replicas
        run one model), in the order the stages name them. A stage that cannot say now
        adds none: the listing does not wait for it."""
        stages = self._stages(None)
        asked = [(s, next(iter(self._pool.urls(s, ready_only=True)), None)) for s in stages]
        answers = await asyncio.gather(
            *(self._call("GET", url, "/control/voices", None) for _, url in asked if url)
        )
        names: dict[str, None] = {}
        for status, answer in answers:
            if status == 200:
                names.update(dict.fromkeys(str(v) for v in answer.get("voices", [])))
        return list(names)

    async def voice_prompt(self, clip: bytes, ref_text: str | None) -> dict[str, Any] | None:
        """An uploaded voice's prompt, made by a ready replica of the talker (each makes
        the same); None when the model clones no voice or no replica can make it now
        (the voice is then spoken from its clip, and its prompt made on a later request).
        ClipRefused when the talker refuses the clip."""
        talker = stage_with_role(self._pipeline(), Role.TALKER)
        if talker is None:
            return None
        body = {"clip": base64.b64encode(clip).decode(), "ref_text": ref_text}
        for url in self._pool.urls(talker, ready_only=True):
            status, answer = await self._call(
                "POST", url, "/control/voice_prompt", body, VOICE_PROMPT_TIMEOUT_SECONDS
            )
            if status == 200:
                return dict(answer["prompt"])
            if status == 400:
                raise ClipRefused(str(answer))
            if status == 409:
                return None  # the model clones none, or its replicas are asleep
        return None

    def adapters(self) -> dict[str, Any]:
        return {
            "adapters": [
                a.model_dump(mode="json", by_alias=True) for a in self._pipeline().adapters
            ]
        }

    def change_adapters(self) -> Conflict:
        if self.local:
            where = (
                "the pipeline file's spec.adapters: change it and reload omnipipe serve "
                "(kill -HUP its pid); an AsyncOmni that started the pipeline itself does "
                "this in add_lora and remove_lora"
            )
        else:
            where = (
                "the OmniPipeline's spec.adapters: on Kubernetes the resource is the source "
                "of truth, so change it (kubectl apply or edit); the workers load the change "
                "without a restart"
            )
        return Conflict(f"LoRA adapters are {where}", code="adapters_in_spec")


def admin_router(service: AdminService) -> APIRouter:
    router = APIRouter(prefix="/admin")

    @router.get("/stages")
    async def states() -> dict[str, Any]:
        return await service.states()

    @router.get("/tokenizer")
    async def tokenizer(stage: str | None = Query(default=None)) -> dict[str, Any]:
        return await service.tokenizer(stage)

    @router.get("/loras")
    async def loras() -> dict[str, Any]:
        return service.adapters()

    @router.post("/loras")
    async def add_lora() -> None:
        raise service.change_adapters()

    @router.delete("/loras/{name}")
    async def remove_lora(name: str) -> None:
        raise service.change_adapters()

    @router.post("/{action}")
    async def act(action: Action, call: AdminCall | None = None) -> dict[str, Any]:
        return await service.act(action, call or AdminCall())

    return router
