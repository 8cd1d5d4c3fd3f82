"""`omnipipe serve tiny://cogvideox`: a text-to-video checkpoint that no family claims is
served whole by the diffusers fallback's video type at /v1/videos, as a user runs it
with the official openai client: the job is created, polled to completion and
downloaded, and the MP4 holds the frames CogVideoXPipeline makes for the seed, at the
size and rate asked; a request the type cannot take is a 400 naming its field, and the
image API sends the client to /v1/videos."""

from __future__ import annotations

import io
import time
from typing import Any

import av
import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import start_serve, stop_cleanly

pytestmark = [
    pytest.mark.timeout(300),
    # openai marks client.videos deprecated (OpenAI's own Sora API ends); the calls and
    # their shapes are what a client of /v1/videos sends, whoever serves it.
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]
MODEL = "tiny://cogvideox"
PROMPT = "a lighthouse at dusk"
# Sent as the openai client sends extensions: form fields beside prompt and size.
CALL = {"num_frames": 9, "num_inference_steps": 3, "guidance_scale": 5.0}
ASKED = {**CALL, "fps": 12, "seed": 5, "negative_prompt": "blurry"}
# H.264 at CRF 18, 4:2:0, of random-weight noise: near the pipeline's frames, not equal.
MEAN_CODEC_ERROR = 0.05


def reference() -> np.ndarray:
    """CogVideoXPipeline's own frames for the request, (frames, height, width, 3)."""
    from diffusers import CogVideoXPipeline

    pipe: Any = CogVideoXPipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        frames = pipe(
            prompt=PROMPT,
            negative_prompt="blurry",
            width=64,
            height=48,
            generator=torch.Generator().manual_seed(5),
            output_type="np",
            **CALL,
        ).frames
    return np.asarray(frames[0])


def completed(c: openai.OpenAI, video_id: str, timeout: float = 60) -> Any:
    """The job once it is done; its progress only grows on the way."""
    deadline, seen = time.monotonic() + timeout, []
    while True:
        video = c.videos.retrieve(video_id)
        seen.append(video.progress)
        if video.status not in ("queued", "in_progress"):
            assert seen == sorted(seen), f"progress went back: {seen}"
            return video
        assert time.monotonic() < deadline, f"still {video.status} after {timeout}s"
        time.sleep(0.2)


def test_a_video_model_with_no_family_is_served_at_v1_videos() -> None:
    served = start_serve(MODEL)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            [listed] = c.models.list().data
            video = c.videos.create(
                model=listed.id,
                prompt=PROMPT,
                size="64x48",  # type: ignore[arg-type]
                extra_body=ASKED,
            )
            assert (video.status, video.size) == ("queued", "64x48")
            with pytest.raises(openai.BadRequestError) as wrong_length:
                c.videos.create(prompt=PROMPT, size="64x48", extra_body={"num_frames": 12})  # type: ignore[arg-type]
            with pytest.raises(openai.BadRequestError) as an_image:
                c.images.generate(model=listed.id, prompt=PROMPT, size="256x256")
            done = completed(c, video.id)
            assert done.status == "completed", done.error
            assert done.progress == 100
            mp4 = c.videos.download_content(video.id).read()
    finally:
        stop_cleanly(served)
    assert "num_frames" in str(wrong_length.value.body)
    assert "/v1/videos" in str(an_image.value.body)
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.average_rate) == ("h264", 12)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    assert frames.shape == (9, 48, 64, 3)
    assert np.abs(frames / 255 - reference()).mean() < MEAN_CODEC_ERROR
