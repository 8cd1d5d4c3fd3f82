"""AsyncOmni's request ids: one id names one running request of a client. A duplicate
is refused while the first runs (even before the router has answered it), abort reaches
that one request, and the id is free again once it has ended. Against a stand-in router
(httpx's MockTransport): no processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from omnipipe.client import AsyncOmni, DuplicateRequestId, OmniError, OmniRequestOutput


class FakeRouter:
    """/v1/omni/generate: holds each request until released, then answers one text
    output per request."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: list[dict[str, object]] = []
        self.arrived = asyncio.Condition()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        async with self.arrived:
            self.bodies.append(body)
            self.arrived.notify_all()
        await self.release.wait()
        rid = body["request_id"]
        if body.get("prompt") == "bad":
            error = {"message": "cfg_interval: bad", "type": "invalid_request_error"}
            error |= {"param": "cfg_interval", "code": None}
            return httpx.Response(400, json={"error": error})
        lines = [
            {"type": "output", "stage": "thinker", "index": 0, "modality": "text"}
            | {"data": {"text": f"reply to {body['prompt']}"}},
            {"type": "finished", "stage": "thinker"},
            {"type": "done"},
        ]
        text = "".join(json.dumps({**line, "request_id": rid}) + "\n" for line in lines)
        return httpx.Response(200, content=text.encode())


@pytest.fixture
async def client() -> AsyncIterator[tuple[AsyncOmni, FakeRouter]]:
    router = FakeRouter()
    omni = AsyncOmni(base_url="http://router.test")
    await omni._http.aclose()
    omni._http = httpx.AsyncClient(
        base_url="http://router.test", transport=httpx.MockTransport(router)
    )
    omni._model = "m"
    yield omni, router
    await omni.shutdown()


async def sent(router: FakeRouter, count: int) -> None:
    """Until `count` requests have reached the router (which has not answered them)."""
    async with router.arrived:
        await router.arrived.wait_for(lambda: len(router.bodies) >= count)


async def collect(outputs: AsyncIterator[OmniRequestOutput]) -> list[OmniRequestOutput]:
    return [o async for o in outputs]


async def test_a_duplicate_id_is_refused_while_the_first_runs(
    client: tuple[AsyncOmni, FakeRouter],
) -> None:
    omni, router = client
    first = asyncio.create_task(collect(omni.generate("one", request_id="r1")))
    await sent(router, 1)
    with pytest.raises(DuplicateRequestId, match="'r1' is already running on this client"):
        await anext(omni.generate("two", request_id="r1"))
    with pytest.raises(ValueError, match="already running"):  # DuplicateRequestId is one
        await anext(omni.generate("three", request_id="r1"))
    assert len(router.bodies) == 1  # the duplicates never reached the router
    router.release.set()
    outs = await first
    assert [o.text for o in outs if o.text] == ["reply to one"]  # the first ran on
    # Ended: the id is free again.
    again = await collect(omni.generate("four", request_id="r1"))
    assert [o.text for o in again if o.text] == ["reply to four"]


async def test_two_racing_calls_with_one_id_run_once(
    client: tuple[AsyncOmni, FakeRouter],
) -> None:
    omni, router = client
    racers = [asyncio.create_task(collect(omni.generate("x", request_id="same"))) for _ in "ab"]
    await asyncio.sleep(0.05)
    router.release.set()
    results = await asyncio.gather(*racers, return_exceptions=True)
    assert sum(isinstance(r, DuplicateRequestId) for r in results) == 1
    assert sum(isinstance(r, list) for r in results) == 1
    assert len(router.bodies) == 1


async def test_abort_reaches_the_one_request_even_before_the_router_answers(
    client: tuple[AsyncOmni, FakeRouter],
) -> None:
    omni, router = client
    aborted = asyncio.create_task(collect(omni.generate("one", request_id="a")))
    other = asyncio.create_task(collect(omni.generate("two", request_id="b")))
    await sent(router, 2)
    await omni.abort("a")
    router.release.set()
    assert await aborted == []
    assert [o.text for o in await other if o.text] == ["reply to two"]
    await omni.abort("a")  # an id no longer running: nothing to do


async def test_a_router_error_keeps_its_param(client: tuple[AsyncOmni, FakeRouter]) -> None:
    omni, router = client
    router.release.set()
    with pytest.raises(OmniError) as err:
        await collect(omni.generate("bad", request_id="e"))
    assert (err.value.status, err.value.param) == (400, "cfg_interval")
    assert err.value.type == "invalid_request_error"
