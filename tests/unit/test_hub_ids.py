"""The released Hub ids resolve to their pipeline types by their model_index.json, as
`omnipipe serve ID` reads it. With no network here, each id's file is written into an
offline Hugging Face cache, where the Hub client finds it as it would a download: it
holds the pipeline class the released file names (and, for Qwen-Image-2512, its
components), so what is tested is the path from a Hub id to its pipeline type, the
class-to-type table included, not the Hub's copy of the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model
from omnipipe.api.resource import ManifestError
from omnipipe.checkpoints.tiny import resolve_model_path

REVISION = "0" * 40
# Hub id -> (its model_index.json's _class_name, the pipeline type that serves it).
RELEASED = {
    "black-forest-labs/FLUX.1-dev": ("FluxPipeline", "flux"),
    "black-forest-labs/FLUX.1-schnell": ("FluxPipeline", "flux"),
    "black-forest-labs/FLUX.1-Kontext-dev": ("FluxKontextPipeline", "flux-kontext"),
    "black-forest-labs/FLUX.2-dev": ("Flux2Pipeline", "flux2"),
    "Tongyi-MAI/Z-Image-Turbo": ("ZImagePipeline", "z-image"),
    "Qwen/Qwen-Image-Edit-2511": ("QwenImageEditPlusPipeline", "qwen-image-edit-plus"),
    "Qwen/Qwen-Image-2512": ("QwenImagePipeline", "qwen-image"),
    "stabilityai/stable-diffusion-3.5-medium": ("StableDiffusion3Pipeline", "diffusers"),
}
# Qwen-Image-2512's model_index.json as released: Qwen-Image's components, new weights.
QWEN_IMAGE_2512 = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.36.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}


def cached(
    hf_home: Path, repo_id: str, index: dict[str, object], filename: str = "model_index.json"
) -> None:
    """The file where huggingface_hub keeps a download of `repo_id`'s `filename`."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / filename).write_text(json.dumps(index))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Read by the Hub client when it is imported: set where it looks now.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


@pytest.mark.parametrize("repo_id", sorted(RELEASED))
def test_a_released_ids_pipeline_class_resolves_to_its_type(
    repo_id: str, offline_hub: Path
) -> None:
    pipeline_class, pipeline = RELEASED[repo_id]
    index = QWEN_IMAGE_2512 if repo_id == "Qwen/Qwen-Image-2512" else {}
    cached(offline_hub, repo_id, {**index, "_class_name": pipeline_class})
    said = checkpoint_descriptors(repo_id)
    assert said == {"model_index.json": pipeline_class}
    assert manifest_for_model(repo_id, said).spec.pipeline == pipeline


def test_offline_a_cached_model_lacks_the_other_kind_of_file(offline_hub: Path) -> None:
    """A transformers model's snapshot has no model_index.json, a diffusers one's no
    config.json: offline, each is read by the file it has, not refused for the other."""
    repo_id = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    cached(offline_hub, repo_id, {"model_type": "qwen3_omni_moe"}, "config.json")
    said = checkpoint_descriptors(repo_id)
    assert said == {"config.json": "qwen3_omni_moe"}
    assert manifest_for_model(repo_id, said).spec.pipeline == "qwen3-omni"
    with pytest.raises(ManifestError, match=r"its model_index\.json could not be read"):
        checkpoint_descriptors("Qwen/Not-Cached")


def test_qwen_image_2512_is_qwen_images_components() -> None:
    """What the qwen-image stages load (tiny://qwen-image is their test checkpoint) is
    what 2512 holds: the same component classes, folder by folder."""
    tiny = json.loads(
        (Path(resolve_model_path("tiny://qwen-image")) / "model_index.json").read_text()
    )
    components = {k: v for k, v in QWEN_IMAGE_2512.items() if not k.startswith("_")}
    assert {k: v for k, v in tiny.items() if not k.startswith("_")} == components
