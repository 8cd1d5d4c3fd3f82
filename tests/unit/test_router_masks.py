"""/v1/images/edits' `mask` at the router, its stages fake workers
(tests/unit/test_router_results.py): on FLUX.1 Kontext (whose pipeline type takes a mask)
the mask reaches the VAE encoder alone, with the images, and the edit is asked at the
input's trained size, as FluxKontextInpaintPipeline makes it; any other type refuses a
mask by name, naming the model; and a mask that is not a PNG with alpha of the image's
size is a 400 naming `mask`. Every refusal comes before any stage is asked."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omnipipe.api import ResolvedPipeline
from tests.unit import test_router_results
from tests.unit.test_router_family_defaults import PNG, client_for, pipeline, sent
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
KONTEXT = ("tiny://flux1-kontext", "flux-kontext")


def image(width: int = 96, height: int = 64, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format=fmt)
    return buf.getvalue()


def rgba_mask(width: int = 96, height: int = 64) -> bytes:
    """OpenAI's mask: opaque but for a transparent box (where the image is edited)."""
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (8, 8, 40, 40))
    buf = io.BytesIO()
    mask.save(buf, format="PNG")
    return buf.getvalue()


def palette_mask() -> bytes:
    """A palette PNG whose transparency is a tRNS chunk: alpha, as PIL and OpenAI read it."""
    mask = Image.new("P", (96, 64), 0)
    mask.paste(1, (8, 8, 40, 40))
    buf = io.BytesIO()
    mask.save(buf, format="PNG", transparency=1)
    return buf.getvalue()


def edit(client: Any, mask: Any, **form: str) -> Any:
    files: list[tuple[str, Any]] = [("image", ("in.png", image(), "image/png"))]
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    data = {"model": "p", "prompt": "a hat", **form}
    return client.post("/v1/images/edits", data=data, files=files)


def refusal(resp: Any, param: str) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    return message


@pytest.mark.parametrize("mask", [rgba_mask(), palette_mask()], ids=["rgba", "trns"])
def test_a_kontext_mask_reaches_the_vae_encoder_alone_at_the_inputs_trained_size(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], mask: bytes
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    with client_for(tmp_path, pipeline(*KONTEXT), serve_worker(worker)) as client:
        auto = edit(client, mask)
        asked = edit(client, mask, size="1248x832")
        other = edit(client, mask, size="64x48")
    for ok in (auto, asked):
        assert ok.status_code == 200, ok.text
        assert ok.json()["size"] == "1248x832"
    assert "1248x832: send size=auto or 1248x832, got 64x48" in refusal(other, "size")
    assert len(worker.submitted) == 2 * 4  # the two accepted edits' four stages, no more
    sent_mask = base64.b64encode(mask).decode()
    # The 96x64 input (3:2) is made at Kontext's trained 1248x832, whatever size was asked.
    denoise = sent(worker, ["encode", "encode-image"])
    assert [(p["width"], p["height"]) for p in denoise] == [(1248, 832)] * 2
    readers = [p for p in sent(worker, []) if "images" in p]
    encoders = [p for p in sent(worker, []) if "images" not in p]
    assert [p["mask"] for p in readers] == [sent_mask] * 2
    assert len(encoders) == 2
    others = encoders + denoise + sent(worker, ["denoise"])
    assert all("mask" not in p for p in others)


def test_an_unmasked_kontext_edit_keeps_the_size_asked(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    with client_for(tmp_path, pipeline(*KONTEXT), serve_worker(worker)) as client:
        assert edit(client, None, size="64x48").status_code == 200
    [denoise] = sent(worker, ["encode", "encode-image"])
    assert (denoise["width"], denoise["height"]) == (64, 48)
    assert all("mask" not in s.params for s in worker.submitted)


@pytest.mark.parametrize(
    ("resolved", "kind"),
    [
        (pipeline("tiny://qwen-image-edit", "qwen-image-edit"), "qwen-image-edit"),
        (pipeline("tiny://flux2-dev", "flux2-edit"), "flux2-edit"),
    ],
)
def test_a_type_that_takes_no_mask_refuses_one_naming_the_model(
    tmp_path: Path,
    serve_worker: Callable[[FakeWorker], str],
    resolved: ResolvedPipeline,
    kind: str,
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    with client_for(tmp_path, resolved, serve_worker(worker)) as client:
        refused = edit(client, rgba_mask())
        assert edit(client, None).status_code == 200  # the same edit, unmasked, is served
    assert refusal(refused, "mask") == f"mask: model 'p' ({kind}) takes no mask"
    assert all("mask" not in s.params for s in worker.submitted)
    assert len(worker.submitted) == 4  # the unmasked edit's stages alone


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (image(), "no alpha channel"),
        (image(mode="L"), "no alpha channel"),
        (image(mode="RGB", fmt="JPEG"), "must be a PNG, got JPEG"),
        (image(mode="RGBA", fmt="WEBP"), "must be a PNG, got WEBP"),
        (b"not an image", "not a PNG, JPEG or WebP image"),
        (rgba_mask(64, 64), "64x64, not the size of the image, 96x64"),
        (rgba_mask(192, 128), "192x128, not the size of the image, 96x64"),
    ],
)
def test_a_bad_mask_is_a_400_naming_mask(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], mask: bytes, words: str
) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    with client_for(tmp_path, pipeline(*KONTEXT), serve_worker(worker)) as client:
        message = refusal(edit(client, mask), "mask")
    assert words in message, message
    assert worker.submitted == []


def test_a_mask_must_be_one_file(tmp_path: Path, serve_worker: Callable[[FakeWorker], str]) -> None:
    worker = FakeWorker(results({"b64_json": PNG}))
    with client_for(tmp_path, pipeline(*KONTEXT), serve_worker(worker)) as client:
        text = client.post(
            "/v1/images/edits",
            data={"model": "p", "prompt": "a hat", "mask": "m"},
            files=[("image", ("in.png", image(), "image/png"))],
        )
        two = client.post(
            "/v1/images/edits",
            data={"model": "p", "prompt": "a hat"},
            files=[
                ("image", ("in.png", image(), "image/png")),
                ("mask", ("a.png", rgba_mask(), "image/png")),
                ("mask", ("b.png", rgba_mask(), "image/png")),
            ],
        )
    for refused in (text, two):
        assert "must be one file part" in refusal(refused, "mask")
    assert worker.submitted == []
