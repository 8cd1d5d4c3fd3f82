"""tiny://wan split into its three stages equals diffusers' one-process WanPipeline: the
same frames, within float rounding of another batch shape, for requests denoised in one
batch with their own seeds, step counts and guidance (with CFG and without); and the
decode stage's MP4 holds those frames."""

from __future__ import annotations

import base64
import io
from typing import Any

import av
import numpy as np
import pytest
import torch

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class

pytestmark = pytest.mark.timeout(600)
BASE = {"width": 64, "height": 48, "num_frames": 9, "num_inference_steps": 4, "fps": 8}
REQUESTS = [
    {**BASE, "prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 1},
    {**BASE, "prompt": "a cat", "guidance_scale": 1.0, "seed": 2},
    {**BASE, "prompt": "a dog on a beach", "guidance_scale": 3.0, "num_inference_steps": 3},
]
# Float rounding: one forward of several rows against the pipeline's forwards of one.
FRAME_TOLERANCE = 1e-4


def pipeline() -> ResolvedPipeline:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "video"},
                "spec": {"model": "tiny://wan", "pipeline": "wan"},
            }
        )
    )


def loaded(name: str) -> Any:
    spec = pipeline().stage(name)
    path = resolve_model_path("tiny://wan")
    stage = stage_class(spec, path)(spec, path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def split() -> list[tuple[np.ndarray, dict[str, Any]]]:
    """Each request's frames through the three stages (one denoise batch), and the
    decode stage's result."""
    encode, denoise, decode = loaded("encode"), loaded("denoise"), loaded("decode")
    jobs = [StageJob(p, {"encode": encode.run(StageJob(p, {})).tensors}) for p in REQUESTS]
    assert len({denoise.batch_key(j) for j in jobs}) == 1
    latents = [r.tensors["latents"] for r in denoise.run_batch(jobs)]
    out = []
    for params, lat in zip(REQUESTS, latents, strict=True):
        [result] = decode.run(StageJob(params, {"denoise": {"latents": lat}})).outputs
        out.append((decode.frames(lat), result))
    return out


def reference(params: dict[str, Any]) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(resolve_model_path("tiny://wan"))
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt=params["prompt"],
        negative_prompt=params.get("negative_prompt"),
        width=params["width"],
        height=params["height"],
        num_frames=params["num_frames"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params.get("guidance_scale", 5.0),
        generator=torch.Generator().manual_seed(params.get("seed", 0)),
        output_type="np",
    ).frames
    return np.asarray(frames[0])


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_the_split_graph_equals_diffusers_one_process_pipeline(
    split: list[tuple[np.ndarray, dict[str, Any]]], i: int
) -> None:
    frames, _ = split[i]
    expected = reference(REQUESTS[i])
    assert frames.shape == expected.shape == (9, 48, 64, 3)
    np.testing.assert_allclose(frames, expected, rtol=0, atol=FRAME_TOLERANCE)
    # Not a test of noise against noise: the frames differ from request to request.
    others = [f for j, (f, _) in enumerate(split) if j != i]
    assert all(np.abs(frames - o).max() > 0.01 for o in others)


def test_the_decode_stage_writes_an_h264_mp4_of_the_frames(
    split: list[tuple[np.ndarray, dict[str, Any]]],
) -> None:
    frames, result = split[0]
    assert {k: result[k] for k in ("frames", "width", "height", "fps")} == {
        "frames": 9,
        "width": 64,
        "height": 48,
        "fps": 8,
    }
    with av.open(io.BytesIO(base64.b64decode(result["b64_mp4"]))) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.average_rate == 8
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    assert decoded.shape == (9, 48, 64, 3)
    # Lossy, but the same pictures: yuv420p at CRF 18 is within a few levels on average.
    assert np.abs(decoded / 255.0 - frames).mean() < 0.05


def test_a_bad_frame_count_or_prompt_is_the_clients_error() -> None:
    encode = loaded("encode")
    with pytest.raises(StageInputError, match="prompt must be a non-empty string"):
        encode.run(StageJob({**BASE, "prompt": ""}, {}))
    with pytest.raises(StageInputError, match="num_frames must be an integer"):
        encode.run(StageJob({**BASE, "prompt": "x", "num_frames": "9"}, {}))


@pytest.mark.parametrize(
    ("change", "refusal", "field"),
    [
        (
            {"width": 1040},
            "width 1040: this model's DiT places at most 1024 pixels a side",
            "size",
        ),
        (
            {"height": 1280},
            "height 1280: this model's DiT places at most 1024 pixels a side",
            "size",
        ),
        (
            {"num_frames": 257},
            "num_frames 257: this model's DiT places at most 253 frames",
            "seconds",
        ),
    ],
)
def test_a_size_or_length_past_the_dits_positions_is_refused_with_its_limit(
    change: dict[str, int], refusal: str, field: str
) -> None:
    """tiny://wan's DiT has rotary positions for 64 patches an axis (rope_max_seq_len),
    fewer than the API's 1280 pixels and 257 frames: a request past them is refused with
    the model's limit before any latent is made, not with torch's words from deep inside.
    The stage publishes the same limits, for the router to check at create."""
    denoise = loaded("denoise")
    assert {(p.param, p.maximum) for p in denoise.param_limits()} == {
        ("width", 1024),
        ("height", 1024),
        ("num_frames", 253),
    }
    embeds = {"prompt_embeds": torch.zeros(1, 4, 16)}
    with pytest.raises(StageInputError, match=refusal) as refused:
        denoise.begin(StageJob({**REQUESTS[0], **change}, {"encode": embeds}))
    assert refused.value.param == field
    # At the limit itself the DiT runs.
    [result] = denoise.run_batch(
        [
            StageJob(
                {
                    **REQUESTS[0],
                    "num_frames": 253,
                    "num_inference_steps": 1,
                    "width": 16,
                    "height": 16,
                },
                {"encode": embeds},
            )
        ]
    )
    assert result.tensors["latents"].shape[2] == 64


def test_the_decode_stages_bytes_are_the_pipelines_frames_rounded() -> None:
    """The decode stage turns the VAE's output into bytes a few frames at a time; they are
    what WanPipeline's own post-processing (frames in [0, 1]) gives, times 255, rounded."""
    from omnipipe.families.wan.stages import FRAMES_AT_A_TIME, rgb_frames

    decode = loaded("decode")
    latents = torch.randn(1, 4, 5, 6, 8, generator=torch.Generator().manual_seed(3))
    # The VAE's output comes a latent frame at a time (the first frame, then 4 a piece),
    # never whole; together, exactly what AutoencoderKLWan.decode gives.
    pieces = list(decode.pieces(latents))
    assert [p.shape[2] for p in pieces] == [1, 4, 4, 4, 4]
    video = torch.cat(pieces, dim=2)
    with torch.inference_mode():
        whole = decode.pipe.vae.decode(latents, return_dict=False)[0]  # tiny: mean 0, std 1
    assert torch.equal(video, whole)
    assert video.shape[2] > FRAMES_AT_A_TIME  # more than one piece of rgb_frames
    whole = decode.pipe.video_processor.postprocess_video(video, output_type="np")[0]
    expected = (np.asarray(whole) * 255).round().clip(0, 255).astype(np.uint8)
    got = rgb_frames(video)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("after_pieces", [0, 2])
def test_a_cancelled_decode_stops_between_pieces_and_leaves_the_vae_clean(
    after_pieces: int,
) -> None:
    """Cancelled before the first piece or between two: no result, no MP4 flushed, and
    the VAE's frame cache cleared on the way out, so the next video decodes whole."""
    decode = loaded("decode")
    latents = torch.randn(1, 4, 5, 6, 8, generator=torch.Generator().manual_seed(5))
    params = {**REQUESTS[0], "num_frames": 17}
    job = StageJob(params, {"denoise": {"latents": latents}})
    pieces: list[int] = []

    def progress() -> None:
        pieces.append(1)
        if len(pieces) > after_pieces:
            job.cancelled.set()

    if after_pieces == 0:
        job.cancelled.set()
    decode.progress = progress
    assert decode.run(job).outputs == []
    assert len(pieces) == after_pieces + 1  # it stopped at the next piece, not the end
    assert all(cached is None for cached in decode.pipe.vae._feat_map)
    decode.progress = lambda: None
    [after] = decode.run(StageJob(params, {"denoise": {"latents": latents}})).outputs
    assert (after["frames"], after["width"], after["height"]) == (17, 64, 48)
    with av.open(io.BytesIO(base64.b64decode(after["b64_mp4"]))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 17
