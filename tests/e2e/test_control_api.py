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

import openai
import pytest
import pytest_asyncio

from omnipipe import AsyncOmni
from omnipipe.client import OmniError
from omnipipe.families.qwen_omni.tiny.qwen25_thinker_lora import save_tiny_thinker_lora
from tests.e2e.conftest import REPO
from tests.e2e.test_python_api import workers_of

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


def newest_thinker_pid(omni: AsyncOmni) -> int:
    """The pid of the thinker worker that started last (a reload may start another)."""
    return [pid for name, (_, pid) in workers_of(omni).items() if name.startswith("thinker")][-1]


async def test_the_vllm_thinker_resets_its_caches_sleeps_and_takes_adapters(
    tmp_path: Path,
) -> None:
    async with AsyncOmni(model="tiny://qwen2.5-omni") as omni:

        async def reply(**params: Any) -> str:
            # Greedy: a tiny random model's sampled tokens follow the seed, not the logits.
            outs = omni.generate("hello", max_tokens=8, temperature=0, **params)
            return "".join([o.text async for o in outs])

        first = await reply()
        prefix = await omni.reset_prefix_cache()
        assert list(prefix["stages"]) == ["thinker"]
        assert set(prefix["skipped"]) == {"talker", "code2wav"}
        await omni.reset_mm_cache(stages=["thinker"])
        tokenizer = await omni.get_tokenizer()
        assert tokenizer.decode(tokenizer("hello").input_ids) == "hello"
        await omni.sleep(level=2, stages=["thinker"])
        assert await reply() == first  # a new vLLM engine, the same greedy tokens

        # The thinker's first adapter restarts it (vLLM enables LoRA as it starts) ...
        assert await omni.add_lora("poet", "tiny://qwen2.5-omni-lora")
        poet = await reply(lora={"name": "poet"})
        assert poet != first
        assert await reply() == first
        with openai.OpenAI(base_url=f"{omni.base_url}/v1", api_key="-", max_retries=0) as c:
            named = c.chat.completions.create(
                model="poet",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
                temperature=0,
            )
            assert named.choices[0].message.content == poet
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(
                    model="poet",
                    messages=[{"role": "user", "content": "hello"}],
                    extra_body={"lora": {"name": "poet", "scale": 0.5}},
                )
            assert err.value.body["param"] == "lora.scale"  # type: ignore[index]
        # ... a second loads into the running engine, and requests mixing them share it.
        thinker_pid = newest_thinker_pid(omni)
        rhymer = save_tiny_thinker_lora(tmp_path / "rhymer", seed=2)
        assert await omni.add_lora("rhymer", str(rhymer))
        assert newest_thinker_pid(omni) == thinker_pid
        alone = {name: await reply(lora={"name": name}) for name in ("poet", "rhymer")}
        assert alone["rhymer"] not in (alone["poet"], first)
        mixed = await asyncio.gather(
            *(reply(lora={"name": n}) for n in ("poet", "rhymer", "poet", "rhymer")), reply()
        )
        assert mixed == [alone["poet"], alone["rhymer"], alone["poet"], alone["rhymer"], first]
        assert await omni.remove_lora("rhymer")
        assert newest_thinker_pid(omni) == thinker_pid
        assert await omni.list_loras() == ["poet"]
