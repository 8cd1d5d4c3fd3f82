"""When an upstream stage's replica dies mid-request, a downstream stage's stream can
break in the same moment (CI saw the talker's cut before the killed thinker's): the
client hears the upstream stage, the cause, and a downstream stage that breaks alone is
still the one named."""

from __future__ import annotations

import asyncio
import json
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


async def test_the_progress_field_goes_only_to_a_stage_asked_for_it() -> None:
    """A worker of an older version forbids fields it does not know: a request that asks
    for no progress sends no `progress` field."""
    bodies: list[dict[str, object]] = []

    async def submit(request: web.Request) -> web.StreamResponse:
        bodies.append(json.loads(await request.read()))
        resp = web.StreamResponse()
        await resp.prepare(request)
        if bodies[-1].get("emit"):
            await resp.write(b'{"type": "result", "data": {"b64_json": "AA=="}}\n')
        await resp.write(b'{"type": "done"}\n')
        return resp

    async with worker_stub(submit) as url:
        orch = await orchestrator({"encode": [url], "denoise": [url], "decode": [url]})
        await run(orch)
        assert [("progress" in b) for b in bodies] == [False, False, False]
        orch = await orchestrator({"encode": [url], "denoise": [url], "decode": [url]})
        bodies.clear()
        try:
            outputs = orch.stream({}, {"decode"}, on_progress=lambda *_: None)
            assert len([o async for o in outputs]) == 1
        finally:
            assert orch.session is not None
            await orch.session.close()
            await orch.pool._client.aclose()
    # Only the denoiser steps.
    assert sorted(str(b.get("progress")) for b in bodies) == ["None", "None", "True"]
