"""One request through the stage graph: choose replicas, submit to all at once, read
every stage's event stream, and cancel everything on the first failure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import httpx

from omnipipe.api import ResolvedPipeline
from omnipipe.api.wire import Destination, StageEvent, SubmitRequest
from omnipipe.router.errors import (
    BadRequest,
    GatewayTimeout,
    OpenAIError,
    Overloaded,
    StageUnavailable,
)
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.replicas import Replica, ReplicaPool

log = logging.getLogger(__name__)


class StageFailed(OpenAIError):
    status, type = 500, "server_error"


def _error_for(stage: str, event: StageEvent) -> OpenAIError:
    if event.code == "invalid_request":
        return BadRequest(event.message, code=event.code)
    if event.code == "timeout":
        return GatewayTimeout(event.message, code=event.code)
    return StageFailed(f"stage {stage} failed: {event.message}", code=event.code or None)


class Orchestrator:
    def __init__(
        self,
        pipeline: ResolvedPipeline,
        pool: ReplicaPool,
        client: httpx.AsyncClient,
        timeout: float,
        max_load: int,
        metrics: RouterMetrics,
        wake_wait: float,
    ) -> None:
        self.pipeline = pipeline
        self.pool = pool
        self.client = client
        self.timeout = timeout
        self.max_load = max_load
        self.metrics = metrics
        self.wake_wait = wake_wait
        self._consumers = {
            s.name: [d.name for d in pipeline.stages if s.name in d.inputs] for s in pipeline.stages
        }

    async def _wait_for_replica(self, stage: str) -> Replica | None:
        """Hold the request while the stage wakes (its demand is exported as
        omnipipe_router_pending_requests, which the autoscaler reads), bounded."""
        # Polls lag by up to a second: look again before anything else.
        await self.pool.refresh(stage)
        replica = self.pool.pick(stage, self.max_load)
        if replica is not None or self.pool.stage_ready(stage) or self.wake_wait <= 0:
            return replica
        gauge = self.metrics.pending.labels(self.pipeline.name, stage)
        gauge.inc()
        try:
            deadline = asyncio.get_running_loop().time() + self.wake_wait
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                await self.pool.refresh(stage)
                replica = self.pool.pick(stage, self.max_load)
                if replica is not None:
                    return replica
            return None
        finally:
            gauge.dec()

    async def _choose(self) -> dict[str, Replica]:
        chosen: dict[str, Replica] = {}
        for stage in self.pipeline.stages:
            replica = self.pool.pick(stage.name, self.max_load)
            if replica is None:
                replica = await self._wait_for_replica(stage.name)
            if replica is None:
                if self.pool.stage_ready(stage.name):
                    raise Overloaded(
                        f"every {stage.name} replica is at capacity; retry later", retry_after=1
                    )
                raise StageUnavailable(
                    f"stage {stage.name} has no ready replica (waited {self.wake_wait:g}s)",
                    retry_after=5,
                )
            chosen[stage.name] = replica
        return chosen

    async def _stream(
        self, stage: str, replica: Replica, submit: SubmitRequest
    ) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        try:
            async with self.client.stream(
                "POST",
                f"{replica.url}/v1/requests",
                content=submit.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(self.timeout, connect=5.0),
            ) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:500]
                    raise StageUnavailable(f"stage {stage} refused the request: {body}")
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    event = StageEvent.model_validate(json.loads(line))
                    if event.type == "result":
                        results.append(event.data)
                    elif event.type == "error":
                        raise _error_for(stage, event)
                    else:
                        return results
        except httpx.HTTPError as exc:
            self.pool.mark_down(replica)
            raise StageUnavailable(f"stage {stage} replica {replica.url} failed: {exc!r}") from exc
        self.pool.mark_down(replica)
        raise StageUnavailable(f"stage {stage} replica {replica.url} closed the stream early")

    async def _cancel(self, request_id: str, chosen: dict[str, Replica]) -> None:
        async def one(replica: Replica) -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(
                    f"{replica.url}/v1/requests/{request_id}/cancel", timeout=2.0
                )

        await asyncio.gather(*(one(r) for r in chosen.values()))

    async def run(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """The user-visible outputs of the pipeline's output stages, in order."""
        request_id = uuid.uuid4().hex
        chosen = await self._choose()
        emitters = set(self.pipeline.outputs)
        tasks: dict[str, asyncio.Task[list[dict[str, Any]]]] = {}
        for replica in chosen.values():
            replica.dispatched += 1
        try:
            for stage in self.pipeline.stages:
                outputs = [
                    Destination(stage=d, address=str(chosen[d].transfer_address))
                    for d in self._consumers[stage.name]
                ]
                submit = SubmitRequest(
                    request_id=request_id,
                    params=params,
                    inputs=list(stage.inputs),
                    outputs=outputs,
                    emit=stage.name in emitters,
                    timeout_seconds=self.timeout,
                )
                tasks[stage.name] = asyncio.create_task(
                    self._stream(stage.name, chosen[stage.name], submit)
                )
            try:
                async with asyncio.timeout(self.timeout):
                    done, _ = await asyncio.wait(
                        tasks.values(), return_when=asyncio.FIRST_EXCEPTION
                    )
            except TimeoutError:
                raise GatewayTimeout(f"request took longer than {self.timeout:g}s") from None
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [r for name in self.pipeline.outputs for r in tasks[name].result()]
        except BaseException:
            for task in tasks.values():
                task.cancel()
            await asyncio.shield(self._cancel(request_id, chosen))
            raise
        finally:
            for replica in chosen.values():
                replica.dispatched -= 1
