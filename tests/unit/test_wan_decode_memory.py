"""Wan's decode stage holds a few frames at a time, not the video: from 9 to 65 frames its
peak memory grows by less than a quarter of one float32 copy of the 56 frames added (what
it grows by is most of all the longer MP4 it answers with). diffusers' decode() and its
post-processing, measured the same way, grow by two copies: the measure sees a video held
whole. At the API's largest video a float32 copy is about 9 GB."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnipipe.stagekit.stage import StageJob
from tests.harness.peak_memory import peak_memory
from tests.unit.test_wan import REQUESTS, loaded

pytestmark = pytest.mark.timeout(300)
HEIGHT, WIDTH = 48, 64  # tiny Wan's VAE makes 8x the latents' 6x8


def latents(latent_frames: int) -> torch.Tensor:
    return torch.randn(1, 4, latent_frames, 6, 8, generator=torch.Generator().manual_seed(3))


def frames_of(latent_frames: int) -> int:
    return 1 + 4 * (latent_frames - 1)


def float32_video_bytes(frames: int) -> int:
    return 3 * frames * HEIGHT * WIDTH * 4


def test_the_decode_stage_holds_pieces_not_the_video() -> None:
    decode = loaded("decode")
    short, long = 3, 17  # latent frames: 9 and 65 frames
    added = float32_video_bytes(frames_of(long) - frames_of(short))

    def ours(latent_frames: int) -> Any:
        params = {**REQUESTS[0], "num_frames": frames_of(latent_frames)}
        job = StageJob(params, {"denoise": {"latents": latents(latent_frames)}})
        return lambda: decode.run(job)

    def diffusers(latent_frames: int) -> Any:
        z = latents(latent_frames)

        def run() -> None:
            with torch.inference_mode():
                video = decode.pipe.vae.decode(z, return_dict=False)[0]
            decode.pipe.video_processor.postprocess_video(video, output_type="np")

        return run

    ours(short)()  # the first call's one-time allocations (caches, codec) stay out
    grew = peak_memory(ours(long)).total - peak_memory(ours(short)).total
    reference_grew = peak_memory(diffusers(long)).total - peak_memory(diffusers(short)).total
    assert reference_grew > 1.5 * added, (reference_grew, added)
    assert grew < 0.25 * added, (grew, added)
