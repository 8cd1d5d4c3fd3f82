"""The Python API (`from omnipipe import AsyncOmni, Omni`) on real local pipelines: it
starts `omnipipe serve` itself or attaches to a running router, yields each stage's
outputs as they are made, aborts, reports health, and shuts down leaving no process."""

from __future__ import annotations

import asyncio
import io
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from PIL import Image

from omnipipe import AsyncOmni, Omni
from omnipipe.client import OmniError, OmniRequestOutput
from tests.e2e.conftest import READY_LINE, REPO, pids_alive

pytestmark = pytest.mark.timeout(600)


def workers_of(omni: AsyncOmni) -> dict[str, tuple[str, int]]:
    """Stage workers (url, pid) of a pipeline that AsyncOmni started, from its serve log."""
    assert omni._log_path is not None
    found = READY_LINE.findall(omni._log_path.read_text())
    return {name: (url, int(pid)) for name, url, pid in found if name != "router"}


def running(url: str) -> int:
    with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
        body = json.loads(r.read())
    return int(body["running"]) + int(body["waiting"])


def test_async_omni_streams_each_stage_and_aborts() -> None:
    async def scenario() -> None:
        async with AsyncOmni(model="tiny://qwen2.5-omni") as omni:
            assert omni.is_running
            assert not omni.errored
            await omni.check_health()
            outs: list[OmniRequestOutput] = [
                o
                async for o in omni.generate(
                    "hello", output_modalities=["text", "audio"], max_tokens=8, seed=7
                )
            ]
            by_stage = {(o.stage, o.final_output_type) for o in outs}
            assert by_stage == {("thinker", "text"), ("code2wav", "audio")}, by_stage
            # Each stage ends with one finished item, after its last output.
            for stage in ("thinker", "code2wav"):
                mine = [o for o in outs if o.stage == stage]
                assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
            audio = [o for o in outs if o.audio]
            assert audio
            assert {o.sample_rate for o in audio} == {24_000}
            text = "".join(o.text for o in outs)
            # The same request flow as the OpenAI endpoint: the same seed, the same reply.
            with openai.OpenAI(base_url=f"{omni.base_url}/v1", api_key="-", max_retries=0) as c:
                reply = c.chat.completions.create(
                    model="tiny://qwen2.5-omni",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=8,
                    seed=7,
                )
            assert reply.choices[0].message.content == text

            # Attached to the running router, as to a cluster endpoint.
            attached = AsyncOmni(base_url=f"{omni.base_url}/v1")
            try:
                outs = [o async for o in attached.generate("hello", max_tokens=8, seed=7)]
                assert "".join(o.text for o in outs) == text
                assert {o.stage for o in outs} == {"thinker"}
            finally:
                await attached.shutdown()

            workers = workers_of(omni)
            long = omni.generate(
                "long",
                request_id="r1",
                sampling_params_list=[{"max_tokens": 4000, "min_tokens": 4000}],
            )
            first = await anext(long)
            assert (first.request_id, first.stage) == ("r1", "thinker")
            with pytest.raises(ValueError, match="already running"):
                await anext(omni.generate("again", request_id="r1"))
            await omni.abort("r1")
            assert [o async for o in long] == []
            deadline = time.monotonic() + 20
            while any(running(url) for url, _ in workers.values()):
                assert time.monotonic() < deadline, "the aborted request still runs"
                await asyncio.sleep(0.2)

            with pytest.raises(OmniError) as refused:
                await anext(omni.generate("x", output_modalities=["image"]))
            assert (refused.value.status, refused.value.type) == (400, "invalid_request_error")
            assert "makes no images" in str(refused.value)
            # mm_processor_kwargs reach the chat plan's own checks.
            with pytest.raises(OmniError, match="use_audio_in_video") as refused:
                await anext(omni.generate("x", mm_processor_kwargs={"bogus": 1}))
            assert refused.value.status == 400
        assert not omni.is_running
        pids = [pid for _, pid in workers.values()]
        assert pids_alive(pids) == []
        with pytest.raises(OmniError, match="shut down"):
            await omni.check_health()

    asyncio.run(scenario())


def test_omni_generates_a_batch_of_images_synchronously() -> None:
    with Omni(stage_configs_path=REPO / "examples/tiny-text-to-image.yaml") as omni:
        results = omni.generate(
            ["a fox", "a cat"], size="64x64", n=2, num_inference_steps=2, seed=3
        )
        assert len(results) == 2
        for result in results:
            assert len(result.images) == 2
            assert {Image.open(io.BytesIO(png)).size for png in result.images} == {(64, 64)}
            assert result.outputs[-1].stage == "decode"
            assert result.outputs[-1].finished
        # One seed per prompt: the two prompts' images differ.
        assert results[0].images != results[1].images
        with pytest.raises(OmniError, match="size must look like"):
            omni.generate("a fox", size="huge")
        assert omni.is_running


def test_a_pipeline_that_cannot_start_is_errored(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: x}\n")

    async def scenario() -> None:
        omni = AsyncOmni(stage_configs_path=bad)
        try:
            with pytest.raises(OmniError, match=r"exited with status 2:[\s\S]*spec"):
                await omni.wait_ready(60)
            assert omni.errored
            assert not omni.is_running
        finally:
            await omni.shutdown()

    asyncio.run(scenario())
