"""The Qwen-Image-Edit-Plus stages (2509, 2511) on tiny://qwen-image-edit-plus, driven by
hand: encode (the prompt beside each input, named), encode-image (each input's latents,
joined) and denoise give the latents diffusers' QwenImageEditPlusPipeline gives run
whole, with the same model, images, prompts and seeds, for one input and for two of
other shapes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_image.edit import EditDenoiseStage, EditTextEncodeStage
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob
from tests.harness.pictures import picture, png_base64
from tests.unit.test_image_edit_stages import PARAMS as EDIT_PARAMS
from tests.unit.test_image_edit_stages import loaded_stages, whole_pipeline_latents

pytestmark = pytest.mark.timeout(600)
MANIFEST = """
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: edit-plus}
spec: {model: "tiny://qwen-image-edit-plus", pipeline: qwen-image-edit-plus}
"""


CAT, SOFA = picture(80, 48, (200, 30, 30)), picture(48, 64, (30, 30, 200))
# The Edit stages' test's request, with its own prompt and an upright size.
PARAMS: dict[str, Any] = {
    **EDIT_PARAMS,
    "prompt": "the cat of picture 1 on the sofa of picture 2",
    "width": 64,
    "height": 96,
}


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path("tiny://qwen-image-edit-plus")


@pytest.fixture(scope="module")
def stages(path: str) -> dict[str, Stage]:
    return loaded_stages(MANIFEST, path)


def test_the_plus_checkpoint_runs_the_edit_stages(stages: dict[str, Stage]) -> None:
    assert type(stages["encode"]) is EditTextEncodeStage
    assert type(stages["denoise"]) is EditDenoiseStage
    assert type(stages["encode"].pipe).__name__ == "QwenImageEditPlusPipeline"


@pytest.mark.parametrize("images", [[CAT], [CAT, SOFA]], ids=["one", "two"])
def test_stages_equal_the_whole_diffusers_pipeline(
    path: str, stages: dict[str, Stage], images: list[Image.Image]
) -> None:
    expected = whole_pipeline_latents(path, images, PARAMS)
    assert type(stages["encode"].pipe).__name__ == "QwenImageEditPlusPipeline"
    params = {**PARAMS, "images": [png_base64(image) for image in images]}
    text = stages["encode"].run(StageJob(params, {})).tensors
    image_latents = stages["encode-image"].run(StageJob(params, {})).tensors
    # Each input at about a megapixel for the VAE, in its own shape.
    shapes = [[50, 82], [74, 56]][: len(images)]  # 1312x800 and 896x1184, over 16
    assert image_latents["image_shapes"].tolist() == shapes
    assert image_latents["image_latents"].shape[1] == sum(h * w for h, w in shapes)
    job = StageJob(params, {"encode": text, "encode-image": image_latents})
    [result] = stages["denoise"].run_batch([job])
    latents = result.tensors["latents"]
    assert latents.shape == expected.shape == (2, 24, 16)
    torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(latents[0], latents[1])


def test_requests_whose_inputs_differ_in_shape_are_not_batched(stages: dict[str, Stage]) -> None:
    """Two inputs of other shapes can make as many latents as one pair; the DiT places
    them by shape, so such requests never share a batch."""
    denoise = stages["denoise"]
    text = {"prompt_embeds": torch.zeros(1, 3, 16), "prompt_mask": torch.ones(1, 3)}

    def key(shapes: list[list[int]]) -> object:
        latents = torch.zeros(1, sum(h * w for h, w in shapes), 16)
        inputs = {"image_latents": latents, "image_shapes": torch.tensor(shapes)}
        return denoise.batch_key(StageJob(PARAMS, {"encode": text, "encode-image": inputs}))

    assert key([[2, 6], [3, 4]]) != key([[3, 4], [2, 6]])
    assert key([[2, 6], [3, 4]]) == key([[2, 6], [3, 4]])


def test_more_inputs_than_the_model_takes_are_refused(stages: dict[str, Stage]) -> None:
    params = {**PARAMS, "images": [png_base64(CAT)] * 4}
    for name in ("encode", "encode-image"):
        with pytest.raises(StageInputError, match="at most 3 input images, got 4"):
            stages[name].run(StageJob(params, {}))
