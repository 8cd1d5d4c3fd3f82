"""FLUX.2's edit types through the router, its stages fake workers
(tests/unit/test_router_results.py): /v1/images/edits sends the reference images, in the
order sent, to the VAE encoder alone, with diffusers' defaults (50 steps, guidance 4);
a LoRA adapter reaches the stages as the openai client names it (lora[name] and
lora[scale] in the form) or as the model; past the model's count of references (10 for
dev, 4 for klein) is a 400 naming the limit, before any stage is asked; and
/v1/images/generations refuses an edit type, while the text-to-image types refuse edits."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.router.api.edits import MAX_FORM_IMAGES
from tests.unit import test_router_results
from tests.unit.test_router_family_defaults import PNG, client_for, pipeline, sent
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
DEV, KLEIN = "tiny://flux2-dev", "tiny://flux2-klein"


def png(width: int, height: int) -> bytes:
    image = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 0)).save(image, format="PNG")
    return image.getvalue()


def files(*sizes: tuple[int, int]) -> list[tuple[str, tuple[str, bytes, str]]]:
    """image[] parts, as the openai client sends a list of images."""
    return [("image[]", (f"{i}.png", png(*s), "image/png")) for i, s in enumerate(sizes)]


def test_an_edit_sends_its_references_to_the_vae_encoder_with_diffusers_defaults(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    parts = files((96, 64), (64, 80))
    with client_for(tmp_path, pipeline(DEV, "flux2-edit"), serve_worker(worker)) as client:
        edit = {"model": "p", "prompt": "the two together", "size": "64x48"}
        got = client.post("/v1/images/edits", data=edit, files=parts)
        assert got.status_code == 200, got.text
    [denoise] = sent(worker, ["encode", "encode-image"])
    assert (denoise["num_inference_steps"], denoise["guidance_scale"]) == (50, 4.0)
    assert (denoise["width"], denoise["height"]) == (64, 48)
    encode, encode_image = sorted(sent(worker, []), key=lambda p: "images" in p)
    assert encode_image["images"] == [base64.b64encode(f[1][1]).decode() for f in parts]
    assert "images" not in encode
    assert "images" not in denoise
    assert "lora" not in denoise


def with_adapter(model: str, kind: str) -> ResolvedPipeline:
    doc = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {
            "model": model,
            "pipeline": kind,
            "adapters": [
                {"name": "ink", "source": "/adapters/ink", "stage": "denoise", "scale": 0.5}
            ],
        },
    }
    return resolve(parse_resource(doc))


def test_a_lora_adapter_reaches_the_stages_by_field_or_by_model(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    resolved = with_adapter(DEV, "flux2-edit")
    edit = {"prompt": "blue", "size": "64x48"}
    with client_for(tmp_path, resolved, serve_worker(worker)) as client:
        for body in (
            {"model": "p", "lora[name]": "ink", "lora[scale]": "0.7"},
            {"model": "ink"},
        ):
            got = client.post("/v1/images/edits", data={**edit, **body}, files=files((64, 64)))
            assert got.status_code == 200, got.text
        refused = {
            name: client.post(
                "/v1/images/edits", data={**edit, "model": "p", **form}, files=files((64, 64))
            )
            for name, form in {
                "unknown": {"lora[name]": "neon"},
                "bad_scale": {"lora[name]": "ink", "lora[scale]": "nan"},
                "no_name": {"lora[scale]": "0.5"},
                "both": {"lora": "ink", "lora[name]": "ink"},
            }.items()
        }
    by_field, by_model = (p["lora"] for p in sent(worker, ["encode", "encode-image"]))
    assert by_field == {"name": "ink", "scale": 0.7}
    assert by_model == {"name": "ink", "scale": 0.5}
    # Each a 400 (an OpenAI error body) naming the field at fault.
    assert {r.status_code for r in refused.values()} == {400}
    errors = {name: r.json()["error"] for name, r in refused.items()}
    params = {name: error["param"] for name, error in errors.items()}
    assert params == {
        "unknown": "lora.name",
        "bad_scale": "lora.scale",
        "no_name": "lora.name",
        "both": "lora",
    }
    assert "no adapter 'neon'" in errors["unknown"]["message"]


@pytest.mark.parametrize(
    ("model", "kind", "most"), [(DEV, "flux2-edit", 10), (KLEIN, "flux2-klein-edit", 4)]
)
def test_past_the_models_references_is_a_400_naming_the_limit(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], model: str, kind: str, most: int
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    edit = {"model": "p", "prompt": "all of them", "size": "64x48"}
    with client_for(tmp_path, pipeline(model, kind), serve_worker(worker)) as client:
        at_most = client.post("/v1/images/edits", data=edit, files=files(*[(64, 64)] * most))
        assert at_most.status_code == 200, at_most.text
        over = client.post("/v1/images/edits", data=edit, files=files(*[(64, 64)] * (most + 1)))
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["param"] == "image"
    assert f"edits with at most {most} input images, got {most + 1}" in error["message"]
    # The form itself takes more, so that the model's limit is the one named.
    assert most < MAX_FORM_IMAGES
    # Only the request within the limit reached the stages.
    assert len(sent(worker, ["encode", "encode-image"])) == 1


def test_each_endpoint_refuses_the_other_kind_of_type(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    url = serve_worker(worker)
    with client_for(tmp_path, pipeline(KLEIN, "flux2-klein-edit"), url) as client:
        generate = client.post(
            "/v1/images/generations", json={"model": "p", "prompt": "x", "size": "64x64"}
        )
    assert generate.status_code == 400
    assert "/v1/images/edits" in generate.json()["error"]["message"]
    with client_for(tmp_path, pipeline(KLEIN, "flux2-klein"), url) as client:
        edit = client.post(
            "/v1/images/edits", data={"model": "p", "prompt": "x"}, files=files((64, 64))
        )
    assert edit.status_code == 400
    assert "/v1/images/generations" in edit.json()["error"]["message"]
    assert worker.submitted == []
