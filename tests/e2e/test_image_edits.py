"""Image editing through the official openai client (images.edit) and curl's multipart
form against `omnipipe serve examples/tiny-image-edit.yaml`, and with several input
images against `omnipipe serve examples/tiny-image-edit-plus.yaml`."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.usage import expected_usage

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-image-edit"
FAST = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = start_serve(REPO / "examples/tiny-image-edit.yaml", timeout=300)
    yield s
    stop_cleanly(s)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as c:
        yield c


def png(width: int = 80, height: int = 48) -> bytes:
    image = Image.new("RGB", (width, height), (200, 30, 30))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode(b64: str | None) -> Image.Image:
    assert b64
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_openai_images_edit_at_a_small_size(client: openai.OpenAI) -> None:
    r = client.images.edit(
        model=MODEL,
        image=("in.png", png(), "image/png"),
        prompt="make it blue",
        size="64x48",  # type: ignore[arg-type]
        n=2,
        extra_body={**FAST, "negative_prompt": "blurry", "seed": 7},
    )
    images = [decode(d.b64_json) for d in r.data or []]
    assert [(i.format, i.size) for i in images] == [("PNG", (64, 48))] * 2
    # Two seeds, two different images.
    assert images[0].tobytes() != images[1].tobytes()
    # In: the prompts' tokens, and the input's DiT tokens at the size the pipeline scales
    # it to (about a megapixel, sides of 32). Out: two images of (64/16) x (48/16).
    width, height, _ = calculate_dimensions(1024 * 1024, 80 / 48)
    image_tokens = (width // 16) * (height // 16)
    assert r.usage is not None
    assert r.usage.model_dump() == expected_usage(
        "tiny://qwen-image-edit", ["make it blue", "blurry"], 2 * 12, image_tokens
    )


def test_openai_list_form_and_bad_images(client: openai.OpenAI) -> None:
    # A list of one image goes out as image[]; auto size keeps the input's aspect ratio.
    r = client.images.edit(
        model=MODEL,
        image=[("in.png", png(64, 64), "image/png")],
        prompt="make it blue",
        extra_body=FAST,
    )
    [item] = r.data or []
    assert decode(item.b64_json).size == (1024, 1024)
    with pytest.raises(openai.BadRequestError, match="not a PNG, JPEG or WebP"):
        client.images.edit(model=MODEL, image=("x.png", b"nope", "image/png"), prompt="x")
    with pytest.raises(openai.BadRequestError, match="at most 1 input image, got 2"):
        client.images.edit(
            model=MODEL,
            image=[("a.png", png(), "image/png"), ("b.png", png(), "image/png")],
            prompt="x",
        )


def test_curl_multipart_edit(served: Served, tmp_path: Path) -> None:
    source = tmp_path / "in.png"
    source.write_bytes(png())
    form = {
        "model": MODEL,
        "prompt": "blue",
        "image": f"@{source};type=image/png",
        "size": "32x32",
        "num_inference_steps": "2",
    }
    fields = [arg for key, value in form.items() for arg in ("-F", f"{key}={value}")]
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", *fields, f"{served.base_url}/images/edits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "200", body
    [item] = json.loads(body)["data"]
    assert decode(item["b64_json"]).size == (32, 32)


def test_an_edit_at_1024(client: openai.OpenAI) -> None:
    r = client.images.edit(
        model=MODEL,
        image=("in.png", png(), "image/png"),
        prompt="make it blue",
        size="1024x1024",
        extra_body={**FAST, "negative_prompt": "blurry"},
    )
    [item] = r.data or []
    assert decode(item.b64_json).size == (1024, 1024)


def test_an_edit_plus_model_edits_with_two_images() -> None:
    """Qwen-Image-Edit-Plus: both inputs reach the stages (another second image, another
    edit; the same two, the same edit for the seed), and a fourth is refused by name."""
    plus = start_serve(REPO / "examples/tiny-image-edit-plus.yaml", timeout=300)
    try:
        with openai.OpenAI(base_url=plus.base_url, api_key="unused", max_retries=0) as c:

            def edit(*images: bytes) -> bytes:
                r = c.images.edit(
                    model="tiny-image-edit-plus",
                    image=[(f"{i}.png", data, "image/png") for i, data in enumerate(images)],
                    prompt="the cat of picture 1 on the sofa of picture 2",
                    size="64x96",
                    extra_body={**FAST, "seed": 5},
                )
                [item] = r.data or []
                image = decode(item.b64_json)
                assert image.size == (64, 96)
                return image.tobytes()

            cat, sofa, chair = png(80, 48), png(48, 64), png(64, 64)
            first = edit(cat, sofa)
            assert edit(cat, sofa) == first
            assert edit(cat, chair) != first
            with pytest.raises(openai.BadRequestError, match="at most 3 input images, got 4"):
                edit(cat, sofa, chair, cat)
    finally:
        stop_cleanly(plus)
