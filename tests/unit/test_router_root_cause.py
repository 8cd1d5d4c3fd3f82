"""When an upstream stage's replica dies mid-request, a downstream stage's stream can
break in the same moment (CI saw the talker's cut before the killed thinker's): the
client hears the upstream stage, the cause, and a downstream stage that breaks alone is
still the one named."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from omnipipe.router.errors import StageUnavailable
from tests.unit.test_router_replan import orchestrator, run


@asynccontextmanager
async def breaking_stub(after: float | None) -> AsyncIterator[str]:
    """A worker whose event stream starts, then (after `after` seconds) drops its
    connection mid-chunk; None: it streams done."""

    async def submit(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        if after is None:
            await resp.write(b'{"type": "done"}\n')
            return resp
        await resp.write(b'{"type": "pa')
        await asyncio.sleep(after)
        assert request.transport is not None
        request.transport.abort()
        return resp

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


async def test_the_upstream_stage_is_named_when_a_downstream_stream_breaks_first() -> None:
    async with (
        breaking_stub(after=0.3) as encode,
        breaking_stub(after=None) as denoise,
        breaking_stub(after=0.05) as decode,
    ):
        orch = await orchestrator({"encode": [encode], "denoise": [denoise], "decode": [decode]})
        with pytest.raises(StageUnavailable) as err:
            await run(orch)
    assert err.value.message == "stage encode failed: its replica went away"


async def test_a_downstream_stage_that_breaks_alone_is_named() -> None:
    async with (
        breaking_stub(after=5.0) as encode,
        breaking_stub(after=None) as denoise,
        breaking_stub(after=0.05) as decode,
    ):
        orch = await orchestrator({"encode": [encode], "denoise": [denoise], "decode": [decode]})
        with pytest.raises(StageUnavailable) as err:
            await run(orch)
    assert err.value.message == "stage decode failed: its replica went away"
