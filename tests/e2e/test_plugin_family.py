"""A model family from outside omnipipe (tests/plugins/sketch, installed beside it through
the omnipipe.families entry point) runs with no change to omnipipe/: `omnipipe families`
lists it, `omnipipe render` and `omnipipe serve` take its model by name, and the openai
client gets its images. Its checkpoint holds the same tiny weights as tiny://qwen-image,
so a request with a seed gets the very image that Qwen-Image's graph makes for it."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline

SKETCH = "tiny://sketch-image"


def omnipipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnipipe.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_families_lists_the_outside_family_beside_omnipipes_own() -> None:
    listed = omnipipe("families")
    assert listed.returncode == 0, listed.stderr
    assert "sketch  (from omnipipe-sketch)" in listed.stdout
    assert "pipeline sketch-image: encode (text-encoder on transformers)" in listed.stdout
    for own in ("bagel", "qwen-image", "qwen-omni"):
        assert f"{own}  (from omnipipe)" in listed.stdout


def test_render_and_crd_take_the_outside_pipeline_type() -> None:
    model = omnipipe("render", SKETCH)
    assert model.returncode == 0, model.stderr
    resource = yaml.safe_load(model.stdout)
    assert resource["spec"] == {"model": SKETCH, "pipeline": "sketch-image"}
    crd = omnipipe("crd")
    assert crd.returncode == 0, crd.stderr
    assert "- sketch-image" in crd.stdout


@pytest.fixture(scope="module")
def both(tmp_module: Path) -> Iterator[tuple[Served, Served]]:
    sketch = start_serve(SKETCH)
    try:
        qwen = start_serve(write_pipeline(tmp_module, "qwen-image"))
    except BaseException:
        stop_cleanly(sketch)
        raise
    yield sketch, qwen
    stop_cleanly(qwen)
    stop_cleanly(sketch)


def image(served: Served, model: str, seed: int) -> bytes:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        r = c.images.generate(
            model=model,
            prompt="a lighthouse at dusk",
            size="64x64",
            extra_body={"num_inference_steps": 3, "seed": seed},
        )
    return base64.b64decode(r.data[0].b64_json or "")


def test_serve_runs_the_outside_family_and_it_makes_qwen_images_images(
    both: tuple[Served, Served],
) -> None:
    sketch, qwen = both
    with openai.OpenAI(base_url=sketch.base_url, api_key="any", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["sketch-image"]
    made = image(sketch, "sketch-image", 7)
    assert made == image(qwen, "qwen-image", 7)
    assert made != image(sketch, "sketch-image", 8)
