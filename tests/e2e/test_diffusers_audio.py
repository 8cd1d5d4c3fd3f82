"""`omnipipe serve tiny://audioldm`: a checkpoint that no family claims and whose pipeline
makes audio is served, as `diffusers-audio`, at POST /v1/audio/generate. Through the
openai client, a WAV holds the audio AudioLDMPipeline makes for the seed (within 16-bit
rounding) at the vocoder's rate, an MP3 decodes to the asked length and rate, and a bad
field or another endpoint is an OpenAI-shaped 400."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import start_serve, stop_cleanly

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny://audioldm"
RATE = 16_000  # the tiny vocoder's, as released
ASKED = {
    "input": "a dog barking in the rain",
    "negative_prompt": "music",
    "audio_length": 0.75,
    "num_inference_steps": 3,
    "guidance_scale": 3.0,
    "seed": 5,
}
# The pipeline's float rounding, and the nearest 16-bit step the WAV holds.
TOLERANCE = 1e-4 + 1 / 32767


def reference() -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    return np.asarray(
        pipe(
            prompt=ASKED["input"],
            negative_prompt=ASKED["negative_prompt"],
            audio_length_in_s=ASKED["audio_length"],
            num_inference_steps=ASKED["num_inference_steps"],
            guidance_scale=ASKED["guidance_scale"],
            generator=torch.Generator().manual_seed(ASKED["seed"]),
            output_type="np",
        ).audios[0]
    )


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    """(mono samples in -1 to 1, their rate), as a client's decoder reads them."""
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    scale = 32767 if samples.dtype == np.int16 else 1
    return samples.astype(np.float64) / scale, frames[0].sample_rate


def test_a_model_that_makes_audio_is_served_at_audio_generate() -> None:
    # The pipeline's own audio is made here while the serve starts: each waits on its
    # imports.
    with ThreadPoolExecutor(1) as background:
        made = background.submit(reference)
        served = start_serve(MODEL)
    try:
        assert any(f"serving {MODEL} as a diffusers-audio pipeline" in s for s in served.output)
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            [listed] = c.models.list().data
            wav = c.post(
                "/audio/generate", body={**ASKED, "model": listed.id}, cast_to=httpx.Response
            )
            mp3 = c.post(
                "/audio/generate",
                body={**ASKED, "response_format": "mp3", "audio_length": 1.5},
                cast_to=httpx.Response,
            )
            with pytest.raises(openai.BadRequestError) as too_long:
                c.post(
                    "/audio/generate",
                    body={"input": "rain", "audio_length": 600},
                    cast_to=httpx.Response,
                )
            with pytest.raises(openai.BadRequestError) as elsewhere:
                c.images.generate(model=listed.id, prompt="rain")
    finally:
        stop_cleanly(served)
    assert wav.headers["content-type"] == "audio/wav"
    samples, rate = decoded(wav.content)
    expected = made.result()
    assert rate == RATE
    assert samples.shape == expected.shape == (int(0.75 * RATE),)
    assert np.abs(expected).max() > 0.05  # not silence, which any two would match
    np.testing.assert_allclose(samples, expected, rtol=0, atol=TOLERANCE)
    assert mp3.headers["content-type"] == "audio/mpeg"
    samples, rate = decoded(mp3.content)
    # MP3 pads the end by up to a frame and the encoder's delay.
    assert (rate, len(samples) / rate) == (RATE, pytest.approx(1.5, abs=0.1))
    error = too_long.value.body
    assert isinstance(error, dict)
    assert error["param"] == "audio_length"
    assert "POST /v1/audio/generate" in str(elsewhere.value.body)
