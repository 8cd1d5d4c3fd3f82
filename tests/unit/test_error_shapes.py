"""Errors name the limit and the field, in one shape: a worker's 400 relayed by the
router has the router's OpenAI shape with a `param`; no message carries a Python object
repr, an internal type name or a replica's address; an image too large is called too
large (with the limit), not undecodable; a data: URL's image type is checked against its
bytes."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from omnipipe.api.wire import StageEvent, SubmitRequest, event_lines
from omnipipe.router.api.inputs import MAX_EDIT_IMAGE_PIXELS, check_edit_image
from omnipipe.router.api.messages import thinker_messages
from omnipipe.router.errors import BadRequest
from omnipipe.stagekit.masks import decode_mask
from omnipipe.stagekit.media import MAX_IMAGE_PIXELS, decode_image
from omnipipe.stagekit.stage import StageInputError, refusal_message
from tests.harness.pictures import broken_png
from tests.unit.test_router_edges import app_for, openai_error
from tests.unit.test_router_results import FakeWorker, router, serve_worker

__all__ = ["serve_worker"]  # the fixture, used by name
REPR = "<PIL.Image.Image image mode=RGB size=1x8000 at 0x7F3A2B1C0D90>"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (its pixels are never there): what a
    reader of headers sees of a 50000x50000 image in a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def encoded(width: int, height: int, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(buffer, kind)
    return buffer.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# ---- limits named, in the worker's decoder and the router's edit check -----------------


@pytest.mark.parametrize(("width", "height"), [(1, 8000), (8000, 1), (2, 400), (300, 60000)])
def test_a_long_strip_is_refused_naming_its_size_and_the_ratio(width: int, height: int) -> None:
    raw = encoded(width, height) if width * height < 10_000_000 else png_header(width, height)
    with pytest.raises(StageInputError) as err:
        decode_image(b64(raw), "messages[0].content[1]")
    message = str(err.value)
    assert message == (
        f"messages[0].content[1]: {width}x{height} is past the aspect-ratio limit: the "
        "longer side must be less than 200 times the shorter"
    )
    assert err.value.param == "messages[0].content[1]"


def test_an_image_whose_body_breaks_after_a_good_header_is_a_400_naming_it() -> None:
    """The router reads headers only: a PNG with a chunk of a bad type passes them, and
    PIL's SyntaxError decoding it was a stage error (a 500)."""
    raw = broken_png(96, 64)
    assert check_edit_image(raw, "image[1]") == (96, 64)
    with pytest.raises(StageInputError, match="image\\[1\\]: not a decodable image"):
        decode_image(b64(raw), "image[1]")
    with pytest.raises(StageInputError, match="mask: not a decodable PNG") as refused:
        decode_mask(b64(raw), (96, 64))
    assert refused.value.param == "mask"


def test_an_image_within_the_ratio_decodes() -> None:
    assert decode_image(b64(encoded(1, 199)), "image").size == (1, 199)


@pytest.mark.parametrize(
    ("width", "height", "said"),
    [
        (50_000, 50_000, "the image"),  # past PIL's own bomb limit: never "undecodable"
        (10_000, 10_000, "10000x10000"),  # past PIL's warning, below its error
        (8_001, 8_000, "8001x8000"),
    ],
)
def test_too_many_pixels_is_called_too_large_with_the_limit(
    width: int, height: int, said: str
) -> None:
    with pytest.raises(StageInputError) as err:
        decode_image(b64(png_header(width, height)), "image")
    assert str(err.value) == f"image: {said} is over the limit of {MAX_IMAGE_PIXELS} pixels"
    assert "decodable" not in str(err.value)


@pytest.mark.parametrize(("width", "height"), [(50_000, 50_000), (20_000, 10_000)])
def test_an_edit_image_past_the_limit_is_too_large_not_malformed(width: int, height: int) -> None:
    with pytest.raises(BadRequest) as err:
        check_edit_image(png_header(width, height))
    assert f"over the limit of {MAX_EDIT_IMAGE_PIXELS} pixels (4096x4096)" in err.value.message
    assert "not a PNG" not in err.value.message
    assert err.value.param == "image"
    with pytest.raises(BadRequest, match=r"5000x5000 is over the limit of 16777216 pixels"):
        check_edit_image(png_header(5000, 5000))


def test_an_engines_refusal_keeps_the_cause_and_drops_reprs() -> None:
    """vLLM wraps the processor's error in one that quotes the whole input, PIL reprs
    and all; and its own validation errors append "(parameter=..., value=...)"."""
    cause = ValueError("absolute aspect ratio must be smaller than 200, got 8000.0")
    wrapped = ValueError(f"Failed to apply Qwen2_5OmniProcessor on data={{'images': [{REPR}]}}")
    wrapped.__cause__ = cause  # as `raise ... from cause` sets it
    assert refusal_message(wrapped) == str(cause)

    class ValidationError(ValueError):
        def __str__(self) -> str:
            return f"{self.args[0]} (parameter=input_text, value=1000000)"

    assert refusal_message(ValidationError("too long")) == "too long"
    assert refusal_message(ValueError(f"bad image {REPR}")) == "bad image an object"
    assert len(refusal_message(ValueError("x" * 10_000))) == 500
    # A feature extractor's or a resampler's words about the samples it was given.
    samples = np.linspace(-1, 1, 48_000, dtype=np.float32).reshape(2, -1)
    about = ValueError(f"audio {samples!r} of shape (2, 24000) is not mono; got {torch.ones(3)!r}")
    assert refusal_message(about) == "audio an array of shape (2, 24000) is not mono; got an array"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("messages[0].content[1]: not a decodable image", "messages[0].content[1]"),
        ("mm_processor_kwargs.fps must be in (0, 8]", "mm_processor_kwargs.fps"),
        ("input must be a non-empty string", "input"),
        ("voice 'alloy' is not available", "voice"),
        ("cfg_interval: two numbers", "cfg_interval"),
        ("nothing to make: ask for text, an image or both", None),
        ("sampling: need temperature >= 0", None),  # the worker's name, not a field
        ("the thinker's prompt has no assistant turn", None),
    ],
)
def test_a_stage_input_error_names_the_request_field_it_starts_with(
    message: str, param: str | None
) -> None:
    assert StageInputError(message).param == param
    assert StageInputError(message, param="size").param == "size"
    # What the worker puts on the request's event stream for the router.
    assert StageInputError(message).event() == StageEvent(
        type="error", code="invalid_request", message=message, param=param or ""
    )


# ---- the router relays a worker's errors in its own shape --------------------------------


def emit_error(**fields: str) -> Callable[[SubmitRequest], Iterator[bytes]]:
    def emit(_body: SubmitRequest) -> Iterator[bytes]:
        yield from event_lines(StageEvent(type="error", **fields))  # type: ignore[arg-type]

    return emit


def test_a_workers_400_has_the_routers_shape_and_its_param(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    message = f"messages[0].content[0]: the processor rejected {REPR} ({np.zeros(9)!r})"
    worker = FakeWorker(
        emit_error(code="invalid_request", message=message, param="messages[0].content[0]")
    )
    with router(tmp_path, serve_worker(worker), pipeline="omni") as client:
        resp = client.post(
            "/v1/chat/completions",
            json={"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}]},
        )
        own = client.post("/v1/chat/completions", json={"model": "tiny-omni", "messages": []})
    relayed, mine = openai_error(resp, 400), openai_error(own, 400)
    assert set(relayed) == set(mine)
    assert (relayed["type"], relayed["code"]) == (mine["type"], mine["code"])
    assert relayed["param"] == "messages[0].content[0]"
    assert relayed["message"] == (
        "messages[0].content[0]: the processor rejected an object (an array)"
    )


@pytest.mark.parametrize(
    "emit",
    [
        emit_error(code="stage_error", message=f"thinker: boom {REPR}"),
        emit_error(code="invalid_request", message="x" * 100_000),
        lambda _body: iter([]),  # closed early
        lambda _body: iter([b"garbage\n"]),
    ],
    ids=["stage-error", "huge", "closed", "garbage"],
)
def test_no_relayed_message_shows_a_repr_an_address_or_a_page(
    tmp_path: Path,
    serve_worker: Callable[[FakeWorker], str],
    emit: Callable[[SubmitRequest], Iterator[bytes]],
) -> None:
    url = serve_worker(FakeWorker(emit))
    with router(tmp_path, url) as client:
        resp = client.post("/v1/images/generations", json={"model": "tiny-image", "prompt": "x"})
    error = openai_error(resp, resp.status_code)
    assert resp.status_code in (400, 500, 503)
    assert " at 0x" not in error["message"]
    assert url not in error["message"]
    assert "127.0.0.1" not in error["message"]
    assert len(error["message"]) <= 1000


# ---- no internal names in param --------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"sampling_params_list": "abc"}, "sampling_params_list"),
        ({"sampling_params_list": [1]}, "sampling_params_list[0]"),
        ({"sampling_params_list": {"thinker": {"top_k": "many"}}}, None),
        ({"modalities": ["video"]}, "modalities[0]"),
        ({"audio": {"format": "mp3"}}, "audio.format"),
        ({"messages": "hi"}, "messages"),
        ({"model": None}, "model"),
    ],
)
def test_param_is_the_field_a_client_sent_never_a_type_name(
    tmp_path: Path, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], **fields}
    with TestClient(app_for(tmp_path, "omni"), raise_server_exceptions=False) as client:
        error = openai_error(client.post("/v1/chat/completions", json=body), 400)
    if param is None:  # a stage's entry: sampling_params_list.<stage>.<field>
        param = "sampling_params_list.thinker.top_k"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    for internal in ("[str,", "nullable", "dict[", "list[nullable", "function-"):
        assert internal not in error["message"]
    missing = {"messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app_for(tmp_path, "omni"), raise_server_exceptions=False) as client:
        error = openai_error(client.post("/v1/chat/completions", json=missing), 400)
    assert error["param"] == "model"


# ---- data: URL types are checked against the bytes -----------------------------------


def image_url(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


PNG, JPEG = encoded(2, 2), encoded(2, 2, "JPEG")
WEBP, GIF = encoded(2, 2, "WEBP"), encoded(2, 2, "GIF")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (f"data:image/png;base64,{b64(JPEG)}", "says image/png but the data is a JPEG image"),
        (f"data:image/jpeg;base64,{b64(PNG)}", "says image/jpeg but the data is a PNG image"),
        (f"data:image/webp;base64,{b64(GIF)}", "says image/webp but the data is a GIF image"),
        (f"data:image/png;base64,{b64(b'just some text')}", "not a decodable image"),
        (f"data:;base64,{b64(b'just some text')}", "not a decodable image"),
        (f"data:text/plain;base64,{b64(PNG)}", "only image/png, image/jpeg"),
        (f"data:image/bmp;base64,{b64(encoded(2, 2, 'BMP'))}", "got 'image/bmp'"),
    ],
)
def test_a_data_url_type_that_is_not_its_content_is_a_400(url: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as err:
        thinker_messages(image_url(url))
    assert err.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    "url",
    [
        f"data:image/png;base64,{b64(PNG)}",
        f"data:IMAGE/PNG;base64,{b64(PNG)}",
        f"data:image/jpeg;base64,{b64(JPEG)}",
        f"data:image/jpg;base64,{b64(JPEG)}",
        f"data:image/webp;base64,{b64(WEBP)}",
        f"data:image/gif;base64,{b64(GIF)}",
        f"data:;base64,{b64(JPEG)}",  # no type: the bytes say what it is
    ],
)
def test_a_data_url_whose_type_is_its_content_passes(url: str) -> None:
    [message] = thinker_messages(image_url(url))
    assert message["content"] == [{"type": "image", "data": url.partition(",")[2]}]


def test_a_stage_that_is_unavailable_tells_the_client_when_to_retry() -> None:
    """A paused stage aborts what it holds (a 503): the client learns when to come back."""
    from omnipipe.router.errors import StageUnavailable
    from omnipipe.router.stage_calls import _error_for

    aborted = _error_for(
        "thinker",
        StageEvent(
            type="error",
            code="stage_unavailable",
            message="thinker: request aborted: generation paused",
        ),
    )
    response = aborted.response()
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert StageUnavailable("x", retry_after=1).response().headers["Retry-After"] == "1"
    assert "Retry-After" not in BadRequest("x").response().headers


def test_vllms_encoder_cache_refusal_names_what_the_client_can_change() -> None:
    """vLLM refuses a media item past its encoder cache naming a server flag; the client
    reads how many tokens its item makes, the most there is room for, and what to send."""
    from vllm.exceptions import VLLMValidationError

    from omnipipe.stagekit.vllm.refusals import engine_refusal

    # vLLM 0.32's words (vllm/v1/engine/input_processor.py), as it raises them.
    said = VLLMValidationError(
        "The decoder prompt contains a(n) video item with 9216 embedding tokens, which "
        "exceeds the pre-allocated encoder cache size 8192. Please reduce the input size or "
        "increase the encoder cache size by setting --limit-mm-per-prompt at startup."
    )
    message = engine_refusal(said)
    assert message == (
        "the video makes 9216 tokens, more than the 8192 the engine's encoder holds for one "
        "item: send a shorter clip, or fewer frames with a lower mm_processor_kwargs.fps"
    )
    assert "--" not in message
    other = VLLMValidationError("too long", parameter="input_text", value=10)
    assert engine_refusal(other) == "too long"
    # The words above are the installed vLLM's: the day they change, this fails.
    import inspect

    from vllm.v1.engine import input_processor

    source = inspect.getsource(input_processor)
    for words in (
        "contains a(n) {modality} item ",
        "with {num_embeds} embedding tokens, which exceeds the ",
        "pre-allocated encoder cache size ",
    ):
        assert words in source, words
