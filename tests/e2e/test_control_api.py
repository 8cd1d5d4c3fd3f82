"""vLLM-Omni's AsyncOmni control calls through omnipipe's Python API, on pipelines that
AsyncOmni starts itself: pause and resume, sleep and the wake a request brings, the
profiler, the tokenizer, the caches, and LoRA adapters added and removed by reloading the
client's own pipeline file; and what an attached client is told."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from omnipipe import AsyncOmni
from omnipipe.client import OmniError
from tests.e2e.conftest import REPO

# One pipeline for the module's tests (each leaves it as it found it), on one loop.
pytestmark = [pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]
IMAGE = {"size": "64x64", "num_inference_steps": 3, "seed": 11}


async def image(omni: AsyncOmni, **params: Any) -> bytes:
    outs = [o.image async for o in omni.generate("a lighthouse", **{**IMAGE, **params}) if o.image]
    assert len(outs) == 1
    return outs[0]


async def started(task: asyncio.Task[Any], seconds: float) -> bool:
    """Whether the task ends within `seconds`."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return bool(done)


async def denoising(omni: AsyncOmni) -> None:
    """Until the denoiser runs a request."""
    async with asyncio.timeout(60):
        while not any(  # noqa: ASYNC110 - the state is the worker's, polled over HTTP
            r["running"] for r in (await omni._admin("GET", "stages"))["stages"]["denoise"]
        ):
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def omni() -> AsyncIterator[AsyncOmni]:
    async with AsyncOmni(stage_configs_path=REPO / "examples/tiny-text-to-image.yaml") as o:
        yield o


async def test_pause_holds_new_requests_and_abort_ends_those_in_flight(omni: AsyncOmni) -> None:
    alone = await image(omni)
    paused = await omni.pause_generation(mode="wait")
    assert set(paused["stages"]) == {"encode", "denoise", "decode"}
    assert await omni.is_paused()
    held = asyncio.create_task(image(omni))
    assert not await started(held, 2.0)
    await omni.resume_generation()
    assert not await omni.is_paused()
    assert await held == alone  # held, not changed

    # A long request is aborted by a pause in abort mode: its client gets a 503.
    long = asyncio.create_task(image(omni, num_inference_steps=200, size="256x256"))
    await denoising(omni)
    aborted = await omni.pause_generation(mode="abort", stages=["denoise"])
    assert sum(r["aborted"] for r in aborted["stages"]["denoise"]) == 1
    with pytest.raises(OmniError) as err:
        await long
    assert err.value.status == 503
    assert "generation paused" in str(err.value)
    await omni.resume_generation(stages=["denoise"])
    assert await image(omni) == alone


async def test_a_stage_asleep_wakes_for_a_request_with_the_same_output(omni: AsyncOmni) -> None:
    alone = await image(omni)
    asleep = await omni.sleep(level=2, stages=["denoise", "decode"])
    assert {r["sleep_level"] for rs in asleep["stages"].values() for r in rs} == {2}
    assert await omni.is_sleeping()
    assert await image(omni) == alone  # woken by the request, reloaded from its files
    states = await omni._states()
    assert not any(r["sleeping"] for r in states)
    await omni.sleep(level=1)
    await omni.wake_up()
    assert not await omni.is_sleeping()
    assert await image(omni) == alone


async def test_a_profile_names_its_trace_and_records_the_denoiser(omni: AsyncOmni) -> None:
    await omni.start_profile(stages=["denoise"])
    await image(omni)
    stopped = await omni.stop_profile(stages=["denoise"])
    [replica] = stopped["stages"]["denoise"]
    trace = json.loads(await asyncio.to_thread(Path(replica["trace"]).read_text))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    with pytest.raises(OmniError, match="not profiling") as err:
        await omni.stop_profile(stages=["denoise"])
    assert err.value.status == 409


async def test_the_tokenizer_and_the_caches_a_stage_does_not_keep(omni: AsyncOmni) -> None:
    tokenizer = await omni.get_tokenizer()
    ids = tokenizer("a lighthouse").input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a lighthouse"
    with pytest.raises(OmniError, match="keeps no prefix cache") as err:
        await omni.reset_prefix_cache()
    assert err.value.status == 409
    with pytest.raises(OmniError, match="no stage 'talker'") as err:
        await omni.pause_generation(stages=["talker"])
    assert err.value.status == 400


async def test_adapters_are_added_and_removed_without_a_restart(omni: AsyncOmni) -> None:
    base = await image(omni)
    assert await omni.list_loras() == []
    assert await omni.add_lora("ink", "tiny://qwen-image-lora")
    assert await omni.list_loras() == ["ink"]
    assert await omni.pin_lora("ink")
    inked = await image(omni, lora={"name": "ink"})
    assert inked != base
    # A source that does not load leaves the set as it was.
    with pytest.raises(OmniError, match="reload failed"):
        await omni.add_lora("ghost", "/nonexistent/lora")
    assert await omni.list_loras() == ["ink"]
    with pytest.raises(ValueError, match="denoiser"):
        await omni.add_lora("odd", "tiny://qwen-image-lora", stage="decode")
    assert await omni.remove_lora("ink")
    assert not await omni.remove_lora("ink")
    assert await omni.list_loras() == []
    assert not await omni.pin_lora("ink")
    assert await image(omni) == base

    # A client attached to the router is told where adapters change.
    attached = AsyncOmni(base_url=omni.base_url)
    try:
        with pytest.raises(OmniError, match=r"pipeline file's spec\.adapters") as err:
            await attached.add_lora("ink", "tiny://qwen-image-lora")
        assert err.value.status == 409
    finally:
        await attached.shutdown()


async def test_the_vllm_thinker_resets_its_caches_and_sleeps() -> None:
    async with AsyncOmni(model="tiny://qwen2.5-omni") as omni:

        async def reply() -> str:
            return "".join([o.text async for o in omni.generate("hello", max_tokens=8, seed=5)])

        first = await reply()
        prefix = await omni.reset_prefix_cache()
        assert list(prefix["stages"]) == ["thinker"]
        assert set(prefix["skipped"]) == {"talker", "code2wav"}
        await omni.reset_mm_cache(stages=["thinker"])
        tokenizer = await omni.get_tokenizer()
        assert tokenizer.decode(tokenizer("hello").input_ids) == "hello"
        await omni.sleep(level=2, stages=["thinker"])
        assert await reply() == first  # a new vLLM engine, the same greedy tokens
