"""Every runnable example is a test: the one `make serve` runs serves an image."""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.e2e.conftest import REPO, assert_serves_a_small_image, start_serve

pytestmark = pytest.mark.timeout(300)


def test_make_serve_example_serves_an_image() -> None:
    served = start_serve(REPO / "examples/tiny-text-to-image.yaml")
    try:
        assert_serves_a_small_image(served.base_url, "tiny-image", steps=4)
    finally:
        served.stop()
    assert served.proc.returncode == 0


def test_serve_model_needs_no_file(tmp_path: Path) -> None:
    """`omnipipe serve MODEL`, as `vllm serve MODEL`: the checkpoint says it is a
    Qwen-Image pipeline, and clients name the model as they gave it. Stopped, it leaves
    none of its state behind."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    served = start_serve("tiny://qwen-image", env={"TMPDIR": str(temporary)})
    try:
        assert any(
            "serving tiny://qwen-image as a qwen-image pipeline" in line for line in served.output
        )
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            [listed] = c.models.list().data
            assert (listed.id, listed.model_extra) == (
                "qwen-image",
                {"root": "tiny://qwen-image", "pipeline": "qwen-image"},
            )
        assert_serves_a_small_image(served.base_url, "tiny://qwen-image")
        assert [p.name for p in temporary.glob("omnipipe-*")]  # its state, while it runs
    finally:
        served.stop()
    assert served.proc.returncode == 0
    assert [p.name for p in temporary.glob("omnipipe-*")] == []


def test_workers_never_outlive_a_killed_serve() -> None:
    import os
    import signal
    import time

    from tests.e2e.conftest import pids_alive

    served = start_serve(REPO / "examples/tiny-text-to-image.yaml")
    pids = [pid for _, pid in served.workers.values()]
    assert len(pids) == 4
    os.kill(served.proc.pid, signal.SIGKILL)  # no chance to clean up
    deadline = time.monotonic() + 20
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    served.stop()
    assert pids_alive(pids) == []


@pytest.mark.parametrize("name", ["tiny-omni", "tiny-qwen3-omni"])
def test_tiny_omni_examples_answer_with_text_and_audio(name: str) -> None:
    served = start_serve(REPO / f"examples/{name}.yaml")
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            r = c.chat.completions.create(
                model=name,
                modalities=["text", "audio"],
                audio={"voice": "Chelsie", "format": "wav"},
                messages=[{"role": "user", "content": "Say hello."}],
                # Unheld, the tiny talker's first code is a stop code about 1 time in 30.
                extra_body={"sampling_params_list": {"talker": {"min_tokens": 16}}},
            )
        audio = r.choices[0].message.audio
        assert audio is not None
        with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
            assert np.frombuffer(w.readframes(w.getnframes()), "<i2").any(), "silent or empty"
        assert r.choices[0].message.content is not None
    finally:
        served.stop()
    assert served.proc.returncode == 0
