"""A replica that never took a request (gone, or draining) costs the client nothing: the
router plans the request again on another replica. A rollout on a real node refused a
request this way when the old revision's pods went in the second before the router's
next poll."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import httpx
import pytest
from aiohttp import web

from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.router.discovery import StaticDiscovery
from omnipipe.router.errors import StageUnavailable
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output
from omnipipe.router.replicas import ReplicaPool

PIPELINE = resolve(
    parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
        }
    )
)
REVISION = pipeline_revision(PIPELINE)


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@asynccontextmanager
async def stage_stub(status: int = 200) -> AsyncIterator[tuple[str, list[str]]]:
    """A worker's submit endpoint: answers `status`, or streams a result and done.
    Yields its URL and the request ids it accepted."""
    accepted: list[str] = []

    async def submit(request: web.Request) -> web.StreamResponse:
        if status != 200:
            return web.Response(status=status, text="draining")
        submitted = SubmitRequest.model_validate_json(await request.read())
        accepted.append(submitted.request_id)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if submitted.emit:
            result = StageEvent(type="result", data={"b64_json": "AA=="})
            await resp.write(result.model_dump_json().encode() + b"\n")
        await resp.write(StageEvent(type="done").model_dump_json().encode() + b"\n")
        return resp

    async with worker_stub(submit) as url:
        yield url, accepted


@asynccontextmanager
async def worker_stub(
    submit: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A worker's request API on loopback, its submissions answered by `submit` and its
    cancels by {}; yields its URL."""

    async def cancel(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/requests", submit)
    app.router.add_post("/v1/requests/{rid}/cancel", cancel)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def orchestrator(replicas: dict[str, list[str]]) -> Orchestrator:
    """Every replica ready at first; each stage's first is the least loaded, so the
    router picks it before the others."""
    pool = ReplicaPool(PIPELINE, StaticDiscovery(replicas), httpx.AsyncClient(), 1.0, 1.0)
    await pool._discover()
    for stage, urls in replicas.items():
        for load, url in enumerate(urls):
            replica = pool._replicas[stage][url]
            replica.ready, replica.revision = True, REVISION
            replica.reported_load = load
            replica.transfer_address = "tcp://127.0.0.1:1"
    orch = Orchestrator(PIPELINE, pool, 10.0, 8, RouterMetrics.create(), 0)
    orch.session = aiohttp.ClientSession()
    return orch


async def run(orch: Orchestrator) -> list[Output]:
    try:
        return [o async for o in orch.stream({}, {"decode"})]
    finally:
        assert orch.session is not None
        await orch.session.close()
        await orch.pool._client.aclose()


@pytest.mark.parametrize("refusal", ["gone", "draining"])
async def test_a_replica_that_never_took_the_request_is_passed_over(refusal: str) -> None:
    async with (
        stage_stub() as (live, accepted),
        stage_stub(503) as (draining, _),
        stage_stub() as (denoise, _),
        stage_stub() as (decode, decoded),
    ):
        refuses = f"http://127.0.0.1:{closed_port()}" if refusal == "gone" else draining
        orch = await orchestrator(
            {"encode": [refuses, live], "denoise": [denoise], "decode": [decode]}
        )
        outputs = await asyncio.wait_for(run(orch), 30)
        assert [(o.stage, o.data) for o in outputs] == [("decode", {"b64_json": "AA=="})]
        # The request ran once, whole, on the replica that took it, under one id.
        assert len(accepted) == 1
        assert decoded[-1] == accepted[0]
        # The refusing replica gets nothing more until a poll finds it ready again.
        assert orch.pool._replicas["encode"][refuses].ready is False


async def test_with_no_replica_left_to_take_it_the_client_gets_a_503() -> None:
    async with stage_stub() as (denoise, _), stage_stub() as (decode, _):
        gone = [f"http://127.0.0.1:{closed_port()}" for _ in range(4)]
        orch = await orchestrator({"encode": gone, "denoise": [denoise], "decode": [decode]})
        with pytest.raises(StageUnavailable):
            await asyncio.wait_for(run(orch), 30)
