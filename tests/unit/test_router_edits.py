"""POST /v1/images/edits at the router, with no stage behind it: the multipart form, the
image's header and the pipeline's kind are checked before any stage runs, and every
refusal is an OpenAI-shaped 400 that names the problem."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from omnipipe.api import load_file, resolve
from omnipipe.router.api.edits import MAX_FORM_IMAGES
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
EDIT = resolve(load_file(REPO / "examples/tiny-image-edit.yaml"))
TEXT_TO_IMAGE = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))
EDIT_PLUS = resolve(load_file(REPO / "examples/tiny-image-edit-plus.yaml"))
FORM = {"model": "tiny-image-edit", "prompt": "make it blue"}


def png(width: int = 64, height: int = 48, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format=fmt)
    return buf.getvalue()


def app_for(tmp_path: Path, pipeline: Any = EDIT, **settings: Any) -> FastAPI:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [] for s in pipeline.stages}))
    values = {"replicas_file": str(replicas), "wake_wait_seconds": 0, **settings}
    return build_app(pipeline, RouterSettings(**values))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as c:
        yield c


def error(resp: Any, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    return err


def post(client: TestClient, data: dict[str, str] | None = None, files: Any = None) -> Any:
    if files is None:
        files = {"image": ("in.png", png(), "image/png")}
    return client.post("/v1/images/edits", data=FORM if data is None else data, files=files)


def test_a_valid_edit_passes_every_check_and_waits_for_stages(client: TestClient) -> None:
    # No replicas: reaching the stages is a 503, so the form, image and size all passed.
    resp = post(client, {**FORM, "size": "32x32", "n": "2", "seed": "1", "negative_prompt": "x"})
    assert error(resp, 503)
    # The openai client's list form, image[], is the same single image.
    assert error(post(client, files=[("image[]", ("a.png", png(), "image/png"))]), 503)
    webp = png(fmt="WEBP")
    assert error(post(client, files={"image": ("a.webp", webp, "image/webp")}), 503)


@pytest.mark.parametrize(
    ("data", "files", "param", "words"),
    [
        ({**FORM}, {}, "image", "a file is required"),
        (
            {**FORM},
            [("image[]", ("a.png", png(), "image/png")), ("image[]", ("b.png", png(), "i/p"))],
            "image",
            "edits with at most 1 input image, got 2",
        ),
        ({**FORM, "image": "text"}, {}, "image", "must be a file part"),
        ({**FORM}, {"image": ("a.txt", b"not an image", "text/plain")}, "image", "not a PNG"),
        ({**FORM}, {"image": ("a.gif", png(fmt="GIF"), "image/gif")}, "image", "got GIF"),
        ({**FORM}, {"image": ("a.png", png(4097, 4097, "1"), "image/png")}, "image", "pixels"),
        ({**FORM}, {"image": ("a.png", png(640, 96), "image/png")}, "image", "at most 4:1"),
        ({"model": "tiny-image-edit"}, None, "prompt", "Field required"),
        ({**FORM, "prompt": ""}, None, "prompt", "at least 1 character"),
        ({**FORM, "size": "big"}, None, "size", "must look like 1024x1024"),
        ({**FORM, "size": "1000x1000"}, None, "size", "multiples of 16"),
        ({**FORM, "n": "11"}, None, "n", "less than or equal to 10"),
        ({**FORM, "guidance_scale": "nan"}, None, "guidance_scale", "plain decimal number"),
        # pydantic would read these as 10, 3 and 3.
        ({**FORM, "n": "1_0"}, None, "n", "plain decimal number"),
        ({**FORM, "output_compression": " 3 "}, None, "output_compression", "plain decimal"),
        ({**FORM, "seed": "\u0663"}, None, "seed", "plain decimal number"),
        ({**FORM, "response_format": "url"}, None, "response_format", "b64_json"),
        ({**FORM, "mask": "m"}, None, "mask", "mask: must be one file part"),
    ],
)
def test_bad_edits_are_400_naming_the_problem(
    client: TestClient, data: dict[str, str], files: Any, param: str | None, words: str
) -> None:
    err = error(post(client, data, files))
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert words in err["message"], err["message"]


def test_an_edit_plus_model_takes_up_to_three_images_each_checked(tmp_path: Path) -> None:
    form = {**FORM, "model": "tiny-image-edit-plus"}

    def images(*sizes: tuple[int, int]) -> list[tuple[str, tuple[str, bytes, str]]]:
        return [("image[]", (f"{i}.png", png(*size), "image/png")) for i, size in enumerate(sizes)]

    with TestClient(app_for(tmp_path, EDIT_PLUS), raise_server_exceptions=False) as c:
        for count in (1, 2, 3):  # 503: every check passed, and no stage is there
            assert error(post(c, form, images(*[(64, 48)] * count)), 503)
        err = error(post(c, form, images(*[(64, 48)] * 4)))
        assert (err["param"], err["message"]) == (
            "image",
            "image: model 'tiny-image-edit-plus' edits with at most 3 input images, got 4",
        )
        # Each input is checked, and named by its place.
        err = error(post(c, form, images((64, 48), (640, 96))))
        assert err["param"] == "image[1]"
        assert "at most 4:1" in err["message"]
        bad = [*images((64, 48)), ("image[]", ("b.txt", b"no image", "text/plain"))]
        assert error(post(c, form, bad))["param"] == "image[1]"
        # Past what any model takes: the form itself is refused.
        too_many = images(*[(16, 16)] * (MAX_FORM_IMAGES + 1))
        assert error(post(c, form, too_many))["param"] is None


def test_unknown_model_is_404(client: TestClient) -> None:
    assert error(post(client, {**FORM, "model": "nope"}), 404)["param"] == "model"


def test_an_image_over_the_byte_limit_is_400(client: TestClient) -> None:
    noise = Image.frombytes("RGB", (2400, 2400), bytes(range(256)) * (2400 * 2400 * 3 // 256))
    buf = io.BytesIO()
    noise.save(buf, format="PNG", compress_level=0)
    assert len(buf.getvalue()) > 16 * 1024 * 1024
    err = error(post(client, files={"image": ("big.png", buf.getvalue(), "image/png")}))
    assert "at most 16777216 bytes" in err["message"] or "larger than" in err["message"]


def test_the_body_limit_still_holds(tmp_path: Path) -> None:
    with TestClient(app_for(tmp_path, max_body_bytes=4096), raise_server_exceptions=False) as c:
        big = {"image": ("a.png", png(64, 64, fmt="BMP") + b"x" * 8192, "image/png")}
        assert error(post(c, files=big), 413)


def test_edit_and_generation_refuse_the_other_kind_of_pipeline(tmp_path: Path) -> None:
    with TestClient(app_for(tmp_path, TEXT_TO_IMAGE), raise_server_exceptions=False) as c:
        err = error(post(c, {**FORM, "model": "tiny-image"}))
        assert "does not edit them" in err["message"]
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as c:
        body = {"model": "tiny-image-edit", "prompt": "a fox", "size": "32x32"}
        err = error(c.post("/v1/images/generations", json=body))
        assert "/v1/images/edits" in err["message"]


def test_a_malformed_multipart_body_is_400(client: TestClient) -> None:
    resp = client.post(
        "/v1/images/edits",
        content=b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n",
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert error(resp)["type"] == "invalid_request_error"
