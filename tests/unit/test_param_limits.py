"""A stage's published limits, as the router and the stage both check them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from omnipipe.api.constants import CREDENTIAL_HEADER
from omnipipe.api.param_limits import ParamLimit, StageLimits, exceeded
from omnipipe.router.stage_limits import KnownLimits
from omnipipe.stagekit.stage import StageInputError, check_param_limits

SIDE = ParamLimit(param="width", maximum=1024, field="size", why="at most 1024 pixels a side")
FRAMES = ParamLimit(param="num_frames", maximum=253, field="seconds", why="at most 253 frames")


def test_the_first_limit_a_number_goes_past_is_named() -> None:
    assert exceeded({"width": 1024, "num_frames": 253}, [SIDE, FRAMES]) is None
    assert exceeded({"width": 1025, "num_frames": 254}, [SIDE, FRAMES]) is SIDE
    assert exceeded({"width": 16, "num_frames": 253.5}, [SIDE, FRAMES]) is FRAMES


@pytest.mark.parametrize("value", [None, "4096", True, [4096]])
def test_what_is_not_a_number_is_left_to_the_parameters_own_checks(value: object) -> None:
    assert exceeded({"width": value}, [SIDE]) is None


def test_the_stage_refuses_with_the_routers_words_and_field() -> None:
    with pytest.raises(StageInputError) as refused:
        check_param_limits({"width": 2048}, [SIDE])
    assert refused.value.message == "width 2048: at most 1024 pixels a side"
    assert refused.value.param == "size"


def test_the_wire_form_round_trips_and_refuses_strangers() -> None:
    sent = StageLimits(stage="denoise", limits=(SIDE, FRAMES))
    assert StageLimits.model_validate_json(sent.model_dump_json()) == sent
    with pytest.raises(ValueError, match="extra"):
        StageLimits.model_validate({"stage": "denoise", "limits": [], "more": 1})


def known_limits(
    answer: Callable[[httpx.Request], httpx.Response], ready: dict[str, str]
) -> tuple[KnownLimits, list[str]]:
    """KnownLimits over a pool whose denoise replicas are `ready` (URL -> revision), each
    answered by `answer`; the URLs asked, in order."""
    from omnipipe.api import parse_resource, resolve
    from omnipipe.router.discovery import StaticDiscovery
    from omnipipe.router.replicas import ReplicaPool

    asked: list[str] = []

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/control/limits":  # the pool's own polls
            return httpx.Response(503)
        asked.append(str(request.url))
        return answer(request)

    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
            }
        )
    )
    client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    pool = ReplicaPool(pipeline, StaticDiscovery({"denoise": list(ready)}), client, 1.0, 1.0)
    asyncio.run(pool._discover())
    for url, revision in ready.items():
        replica = pool._replicas["denoise"][url]
        replica.ready, replica.revision = True, revision
    return KnownLimits(pool, client, {CREDENTIAL_HEADER: "c"}), asked


def published(request: httpx.Request) -> httpx.Response:
    assert request.headers.get(CREDENTIAL_HEADER) == "c"
    body = StageLimits(stage="denoise", limits=(SIDE,))
    return httpx.Response(200, content=body.model_dump_json())


def test_the_router_asks_one_replica_a_revision_and_keeps_its_answer() -> None:
    known, asked = known_limits(published, {"http://a": "r1", "http://b": "r1"})

    async def twice() -> list[list[ParamLimit]]:
        first = await known.of(["encode", "denoise", "gone"], "r1")
        return [first, await known.of(["denoise"], "r1")]

    assert asyncio.run(twice()) == [[SIDE], [SIDE]]
    assert asked == ["http://a/control/limits"]


def test_the_revision_the_request_starts_on_is_asked_first() -> None:
    known, asked = known_limits(published, {"http://a": "old", "http://b": "new"})
    assert asyncio.run(known.of(["denoise"], "new")) == [SIDE]
    assert asked == ["http://b/control/limits"]
    # The old revision's answer is its own: kept apart, asked of its own replica.
    assert asyncio.run(known.of(["denoise"], "old")) == [SIDE]
    assert asked == ["http://b/control/limits", "http://a/control/limits"]


def test_a_replica_that_cannot_say_is_passed_over_and_none_holds_the_request() -> None:
    def stuck_then_published(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ReadTimeout("stuck", request=request)
        return published(request)

    known, asked = known_limits(stuck_then_published, {"http://a": "r1", "http://b": "r1"})
    assert asyncio.run(known.of(["denoise"], "r1")) == [SIDE]
    assert asked == ["http://a/control/limits", "http://b/control/limits"]
    # A worker from before the route (404) has none to give; an upgrade in place may
    # replace it under the same revision, so it is asked again, not taken at its word.
    older, asked = known_limits(lambda r: httpx.Response(404), {"http://a": "r0"})
    assert asyncio.run(older.of(["denoise"], "r0")) == []
    assert asyncio.run(older.of(["denoise"], "r0")) == []
    assert asked == ["http://a/control/limits"] * 2
    # An answer that is not StageLimits: no limits, and asked again.
    bad, asked = known_limits(lambda r: httpx.Response(200, json={"x": 1}), {"http://a": "r1"})
    assert asyncio.run(bad.of(["denoise"], "r1")) == []
    assert asyncio.run(bad.of(["denoise"], "r1")) == []
    assert len(asked) == 2
    # No replica ready: nothing asked, no limits (the stage checks when the job reaches it).
    idle, asked = known_limits(published, {})
    assert asyncio.run(idle.of(["denoise"], None)) == []
    assert asked == []
