"""A family's defaults reach its stages through the router: FLUX.1's 28 steps and
guidance 3.5 where the client sent neither (not the image API's 50 and 4), on
/v1/images/generations and, for Kontext, on /v1/images/edits; what the client sent is
kept. The stages are fake workers (tests/unit/test_router_results.py)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from tests.unit import test_router_results
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
PNG = base64.b64encode(b"\x89PNG").decode()  # what the fake decode stage answers


def pipeline(model: str, kind: str) -> ResolvedPipeline:
    doc = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"model": model, "pipeline": kind},
    }
    return resolve(parse_resource(doc))


def client_for(tmp_path: Path, resolved: ResolvedPipeline, url: str) -> TestClient:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in resolved.stages}))
    settings = RouterSettings(replicas_file=str(replicas), wake_wait_seconds=0)
    return TestClient(build_app(resolved, settings), raise_server_exceptions=False)


def sent(worker: FakeWorker, inputs: list[str]) -> list[dict[str, Any]]:
    """The parameters of the submissions of the stage that waits for `inputs` (every
    stage shares the one fake worker; a submission names its inputs, not its stage)."""
    return [s.params for s in worker.submitted if s.inputs == inputs]


def test_flux_generations_take_fluxs_defaults_where_none_were_sent(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    flux = pipeline("tiny://flux1-dev", "flux")
    with client_for(tmp_path, flux, serve_worker(worker)) as client:
        for body in ({}, {"num_inference_steps": 4, "guidance_scale": 0}):
            got = client.post(
                "/v1/images/generations",
                json={"model": "p", "prompt": "x", "size": "64x64", **body},
            )
            assert got.status_code == 200, got.text
    first, second = sent(worker, ["encode"])
    assert (first["num_inference_steps"], first["guidance_scale"]) == (28, 3.5)
    assert (second["num_inference_steps"], second["guidance_scale"]) == (4, 0)


def test_kontext_edits_take_its_defaults_and_refuse_a_negative_prompt(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    kontext = pipeline("tiny://flux1-kontext", "flux-kontext")
    image = io.BytesIO()
    Image.new("RGB", (64, 48)).save(image, format="PNG")
    files = {"image": ("in.png", image.getvalue(), "image/png")}
    with client_for(tmp_path, kontext, serve_worker(worker)) as client:
        edit = {"model": "p", "prompt": "make it blue", "size": "64x48"}
        assert client.post("/v1/images/edits", data=edit, files=files).status_code == 200
        refused = client.post(
            "/v1/images/edits", data={**edit, "negative_prompt": "blurry"}, files=files
        )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "negative_prompt"
    [denoise] = sent(worker, ["encode", "encode-image"])
    assert (denoise["num_inference_steps"], denoise["guidance_scale"]) == (28, 3.5)
    # The VAE encoder reads the input; CLIP and T5 (encode) and the rest are not sent it.
    encode, encode_image = sorted(sent(worker, []), key=lambda p: "images" in p)
    assert encode_image["images"] == [base64.b64encode(image.getvalue()).decode()]
    assert "images" not in encode
    assert "images" not in denoise


def test_omni_generate_takes_the_familys_defaults_as_the_image_api_does(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """/v1/omni/generate's image requests pass through the family's extensions too: the
    diffusers fallback leaves unset steps and guidance to its pipeline (None), FLUX.1
    gets its 28 and 3.5."""
    worker = FakeWorker(results({"b64_json": PNG}))
    for model, kind, stage, want in (
        ("tiny://flux1-dev", "flux", ["encode"], (28, 3.5)),
        ("tiny://sd3", "diffusers", [], (None, None)),
    ):
        with client_for(tmp_path, pipeline(model, kind), serve_worker(worker)) as client:
            got = client.post("/v1/omni/generate", json={"model": "p", "prompt": "x"})
            assert got.status_code == 200, got.text
        params = sent(worker, stage)[-1]
        assert (params["num_inference_steps"], params["guidance_scale"]) == want


def test_a_negative_prompt_is_taken_where_the_familys_cfg_runs(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """Z-Image's CFG runs at any guidance above 0: a negative prompt at 0.5 is served
    (true CFG's rule, above 1, would refuse it), at 0 refused naming guidance_scale."""
    worker = FakeWorker(results({"b64_json": PNG}))
    body = {"model": "p", "prompt": "x", "size": "64x64", "negative_prompt": "fog"}
    zimage = pipeline("tiny://z-image", "z-image")
    with client_for(tmp_path, zimage, serve_worker(worker)) as client:
        served = client.post("/v1/images/generations", json={**body, "guidance_scale": 0.5})
        refused = client.post("/v1/images/generations", json={**body, "guidance_scale": 0})
    assert served.status_code == 200, served.text
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "guidance_scale"
    assert "above 0" in refused.json()["error"]["message"]
    qwen = pipeline("tiny://qwen-image", "qwen-image")
    with client_for(tmp_path, qwen, serve_worker(worker)) as client:
        refused = client.post("/v1/images/generations", json={**body, "guidance_scale": 0.5})
    assert refused.status_code == 400
    assert "above 1" in refused.json()["error"]["message"]
