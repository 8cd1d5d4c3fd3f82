"""The Qwen-Image-Edit stages on tiny://qwen-image-edit, driven by hand (no processes):
encode, encode-image and denoise give the latents diffusers' QwenImageEditPipeline gives
run whole, with the same model, image, prompts and seeds."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch
import yaml
from PIL import Image

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.api.spec import Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_image.edit import (
    EditDenoiseStage,
    EditTextEncodeStage,
    ImageEncodeStage,
)
from omnipipe.families.qwen_image.stages import DecodeStage
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class

pytestmark = pytest.mark.timeout(600)
MANIFEST = """
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: edit}
spec: {model: "tiny://qwen-image-edit", pipeline: qwen-image-edit}
"""


def _png() -> bytes:
    image = Image.new("RGB", (80, 48), (200, 30, 30))
    for x in range(80):
        image.putpixel((x, x % 48), (0, 255, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
PARAMS: dict[str, Any] = {
    "prompt": "make it blue",
    "negative_prompt": "blurry",
    "images": [base64.b64encode(PNG).decode()],
    "width": 96,
    "height": 64,
    "n": 2,
    "seed": 3,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
}


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path("tiny://qwen-image-edit")


def loaded_stages(manifest: str, path: str) -> dict[str, Stage]:
    """Every stage of the pipeline `manifest` describes, loaded from `path` on the CPU."""
    pipeline: ResolvedPipeline = resolve(parse_resource(yaml.safe_load(manifest)))
    out = {}
    for spec in pipeline.stages:
        stage = stage_class(spec, path)(spec, path, "cpu")
        stage.load()
        out[spec.name] = stage
    return out


@pytest.fixture(scope="module")
def stages(path: str) -> dict[str, Stage]:
    return loaded_stages(MANIFEST, path)


def whole_pipeline_latents(path: str, image: Any, params: dict[str, Any]) -> torch.Tensor:
    """The latents of the checkpoint's own diffusers pipeline, run whole on `image` (one
    or a list) for the request `params`, two images with seeds 3 and 4."""
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        latents: torch.Tensor = pipe(
            image=image,
            prompt=params["prompt"],
            negative_prompt=params["negative_prompt"],
            true_cfg_scale=params["guidance_scale"],
            height=params["height"],
            width=params["width"],
            num_inference_steps=params["num_inference_steps"],
            num_images_per_prompt=2,
            generator=[torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)],
            output_type="latent",
        ).images
    return latents


def test_the_checkpoint_picks_the_edit_stages(stages: dict[str, Stage]) -> None:
    assert {name: type(s) for name, s in stages.items()} == {
        "encode": EditTextEncodeStage,
        "encode-image": ImageEncodeStage,
        "denoise": EditDenoiseStage,
        "decode": DecodeStage,
    }
    assert stages["encode-image"].spec.role is Role.VAE_ENCODER


def test_stages_equal_the_whole_diffusers_pipeline(path: str, stages: dict[str, Stage]) -> None:
    expected = whole_pipeline_latents(path, Image.open(io.BytesIO(PNG)), PARAMS)

    encoded = stages["encode"].run(StageJob(PARAMS, {})).tensors
    image_latents = stages["encode-image"].run(StageJob(PARAMS, {})).tensors
    # The VAE sees the image at about a megapixel, whatever size the edit asks for: its
    # latents packed in 2x2 patches, 50 x 82 of them.
    assert tuple(image_latents["image_latents"].shape) == (1, 50 * 82, 16)
    assert image_latents["image_shapes"].tolist() == [[50, 82]]
    steps: list[int] = []
    denoise = stages["denoise"]
    denoise.progress = lambda: steps.append(1)
    job = StageJob(PARAMS, {"encode": encoded, "encode-image": image_latents})
    [result] = denoise.run_batch([job])
    latents = result.tensors["latents"]
    assert latents.shape == expected.shape == (2, 24, 16)
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)
    assert len(steps) == 2
    # The two images have their own seeds, and CFG changed the result.
    assert not torch.allclose(latents[0], latents[1])

    [decoded] = [stages["decode"].run(StageJob(PARAMS, {"denoise": {"latents": latents}}))]
    sizes = [Image.open(io.BytesIO(base64.b64decode(o["b64_json"]))).size for o in decoded.outputs]
    assert sizes == [(96, 64), (96, 64)]


def test_a_cancelled_edit_stops_before_its_first_step(stages: dict[str, Stage]) -> None:
    enc = {"prompt_embeds": torch.zeros(1, 3, 16), "prompt_mask": torch.ones(1, 3)}
    image = {"image_latents": torch.zeros(1, 50 * 82, 16), "image_shapes": torch.tensor([[50, 82]])}
    job = StageJob({**PARAMS, "n": 1}, {"encode": enc, "encode-image": image})
    job.cancelled.set()
    steps: list[int] = []
    stages["denoise"].progress = lambda: steps.append(1)
    [result] = stages["denoise"].run_batch([job])
    assert steps == []
    assert result.tensors["latents"].shape == (1, 24, 16)


@pytest.mark.parametrize(
    "images",
    [
        [""],
        ["not base64!"],
        [base64.b64encode(b"not an image").decode()],
        [],
        "not a list",
        [base64.b64encode(PNG).decode()] * 2,  # this model edits one
    ],
)
def test_a_bad_input_image_is_the_clients_error(stages: dict[str, Stage], images: Any) -> None:
    for name in ("encode", "encode-image"):
        with pytest.raises(StageInputError, match="image"):
            stages[name].run(StageJob({**PARAMS, "images": images}, {}))
