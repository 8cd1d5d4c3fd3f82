"""The image decode stage (stagekit/image_decode.py) shares the VAE's forwards among
requests of one size, within a pixel bound: each request's images equal its images
decoded alone; a forward holds at most MAX_FORWARD_PIXELS (one image when larger); a
request cancelled meanwhile gets none and the others theirs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.stagekit import image_decode
from omnipipe.stagekit.stage import StageJob
from tests.unit.test_z_image import loaded

SIZE = {"width": 64, "height": 48}
# Float rounding between a forward of several rows and one of one.
PIXEL_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def decode() -> Any:
    return loaded("tiny://z-image", "decode")


def job(n: int, seed: int, **params: Any) -> StageJob:
    """A request of n images at SIZE, its latents as the denoiser hands them over."""
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(n, 16, 6, 8, generator=generator)
    return StageJob({**SIZE, "n": n, **params}, {"denoise": {"latents": latents}})


def forwards(decode: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each VAE forward the stage runs from now on."""
    seen: list[int] = []
    vae_decode = decode.pipe.vae.decode

    def counted(rows: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(rows))
        return vae_decode(rows, *args, **kwargs)

    monkeypatch.setattr(decode.pipe.vae, "decode", counted)
    return seen


def test_requests_of_one_size_share_forwards_and_equal_their_images_alone(
    decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [job(1, 1), job(2, 2), job(1, 3)]
    alone = [np.stack(decode.decode_batch([j], "np")[0]) for j in jobs]
    seen = forwards(decode, monkeypatch)
    together = decode.decode_batch(jobs, "np")
    assert seen == [4]
    for mine, theirs in zip(together, alone, strict=True):
        assert mine is not None
        assert np.abs(np.stack(mine) - theirs).max() <= PIXEL_TOLERANCE
    assert np.abs(alone[0] - alone[2]).max() > 0.01  # each its own latents
    # The size is the key: another size never shares a call.
    assert decode.batch_key(jobs[0]) == decode.batch_key(jobs[1])
    assert decode.batch_key(jobs[0]) != decode.batch_key(job(1, 4, width=48))


def test_a_forward_holds_at_most_the_pixel_bound(
    decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = forwards(decode, monkeypatch)
    monkeypatch.setattr(image_decode, "MAX_FORWARD_PIXELS", 2 * 64 * 48)
    decode.decode_batch([job(3, 1), job(2, 2)], "np")
    assert seen == [2, 2, 1]
    seen.clear()
    # An image past the bound goes alone.
    monkeypatch.setattr(image_decode, "MAX_FORWARD_PIXELS", 100)
    decode.decode_batch([job(2, 1)], "np")
    assert seen == [1, 1]


def test_a_cancelled_request_gets_no_images_and_the_others_theirs(decode: Any) -> None:
    gone, kept = job(2, 1), job(1, 2)
    gone.cancelled.set()
    results = decode.run_batch([gone, kept])
    assert results[0].outputs == []
    assert len(results[1].outputs) == 1
