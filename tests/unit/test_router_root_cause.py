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
from tests.unit.test_router_replan import orchestrator, run, worker_stub


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

    async with worker_stub(submit) as url:
        yield url


@pytest.mark.parametrize(
    ("encode_breaks_after", "named"),
    [
        # encode's replica dies a moment after decode's stream broke: encode is the cause.
        (0.3, "encode"),
        # decode's stream breaks and encode goes on: decode is the one named.
        (5.0, "decode"),
    ],
)
async def test_the_stage_named_is_the_upstream_one_that_broke(
    encode_breaks_after: float, named: str
) -> None:
    async with (
        breaking_stub(after=encode_breaks_after) as encode,
        breaking_stub(after=None) as denoise,
        breaking_stub(after=0.05) as decode,
    ):
        orch = await orchestrator({"encode": [encode], "denoise": [denoise], "decode": [decode]})
        with pytest.raises(StageUnavailable) as err:
            await run(orch)
    assert err.value.message == f"stage {named} failed: its replica went away"
