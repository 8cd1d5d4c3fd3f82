"""BAGEL (examples/tiny-bagel.yaml) through `omnipipe serve` and the official openai
client: images from /v1/images/generations, chat answers in text then an image, image
input for editing-style prompts, and the request extensions refused with OpenAI-shaped
400s when malformed."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import REPO, Served, start_serve

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-bagel"
SMALL = {"size": "64x64", "num_inference_steps": 4}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    served: Served = start_serve(REPO / "examples/tiny-bagel.yaml")
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            yield c
    finally:
        served.stop()
    assert served.proc.returncode == 0


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.int16)


def from_data_url(part: dict[str, Any]) -> np.ndarray:
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return pixels(url.partition(",")[2])


def blue_square() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (0, 0, 255)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_images_generations_with_cfg_scales(client: openai.OpenAI) -> None:
    def make(**extra: Any) -> np.ndarray:
        r = client.images.generate(
            model=MODEL,
            prompt="a red fox",
            size="64x64",
            extra_body={"seed": 7, "num_inference_steps": 4, **extra},
        )
        return pixels(r.data[0].b64_json or "")

    first = make(cfg_text_scale=4.0)
    assert first.shape == (64, 64, 3)
    assert np.array_equal(make(cfg_text_scale=4.0), first)  # same seed, same image
    assert np.abs(make(cfg_text_scale=1.0) - first).max() > 0  # CFG off changes it


def test_n_images_and_an_image_only_chat(client: openai.OpenAI) -> None:
    r = client.images.generate(
        model=MODEL, prompt="a red fox", size="64x64", n=2, extra_body={"num_inference_steps": 4}
    )
    first, second = (pixels(d.b64_json or "") for d in r.data)
    assert np.abs(first - second).max() > 0  # the second image has the next seed
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a fox"}],
        modalities=["image"],  # type: ignore[list-item]
        extra_body=SMALL,
    )
    assert chat.choices[0].message.content == ""
    [image] = (chat.choices[0].message.model_extra or {})["images"]
    assert from_data_url(image).shape == (64, 64, 3)


def test_chat_answers_text_then_an_image(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "draw a fox"}],
        max_tokens=8,
        modalities=["text", "image"],  # type: ignore[list-item]
        extra_body=SMALL,
    )
    message = r.choices[0].message
    assert message.content is not None
    assert r.usage is not None
    assert r.usage.completion_tokens >= 1
    [image] = (message.model_extra or {})["images"]
    assert from_data_url(image).shape == (64, 64, 3)


def test_streamed_chat_sends_the_image_after_the_text(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "draw a fox"}],
        max_tokens=8,
        modalities=["text", "image"],  # type: ignore[list-item]
        stream=True,
        extra_body=SMALL,
    )
    kinds = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if delta.content:
            kinds.append("text")
        if extra.get("images"):
            assert from_data_url(extra["images"][0]).shape == (64, 64, 3)
            kinds.append("image")
        if chunk.choices[0].finish_reason:
            kinds.append("finish")
    assert "text" in kinds
    assert kinds[-2:] == ["image", "finish"]
    assert kinds.count("image") == 1


def test_chat_understands_and_edits_an_input_image(client: openai.OpenAI) -> None:
    content: Any = [
        {"type": "image_url", "image_url": {"url": blue_square()}},
        {"type": "text", "text": "make it red"},
    ]
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4
    )
    assert (text.choices[0].message.model_extra or {}).get("images") is None
    assert text.usage is not None
    assert text.usage.prompt_tokens > 16  # the ViT's tokens
    edit = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        modalities=["text", "image"],  # type: ignore[list-item]
        extra_body={**SMALL, "cfg_img_scale": 2.0},
    )
    [image] = (edit.choices[0].message.model_extra or {})["images"]
    assert from_data_url(image).shape == (64, 64, 3)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"cfg_text_scale": -1}, "cfg_text_scale"),
        ({"cfg_img_scale": "big"}, "cfg_img_scale"),
        ({"cfg_interval": [0.2, 3]}, "cfg_interval"),
        ({"timestep_shift": 0}, "timestep_shift"),
    ],
)
def test_malformed_extensions_are_openai_400s(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as images_error:
        client.images.generate(model=MODEL, prompt="a fox", size="64x64", extra_body=extra)
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a fox"}],
            modalities=["text", "image"],  # type: ignore[list-item]
            extra_body={**SMALL, **extra},
        )
    for error in (images_error.value, chat_error.value):
        assert error.status_code == 400
        assert isinstance(error.body, dict)
        assert error.body["type"] == "invalid_request_error"
        assert param in error.body["message"]


def test_guidance_scale_is_the_text_cfg_scale_and_negative_prompt_is_refused(
    client: openai.OpenAI,
) -> None:
    def make(**extra: Any) -> np.ndarray:
        r = client.images.generate(
            model=MODEL,
            prompt="a red fox",
            size="64x64",
            extra_body={"seed": 5, "num_inference_steps": 4, **extra},
        )
        return pixels(r.data[0].b64_json or "")

    assert np.array_equal(make(guidance_scale=2.0), make(cfg_text_scale=2.0))
    with pytest.raises(openai.BadRequestError, match="negative_prompt"):
        make(negative_prompt="blurry")


def test_malformed_chat_images_are_400s(client: openai.OpenAI) -> None:
    bad: list[dict[str, Any]] = [
        {"size": "64x60"},  # not a multiple of 16
        {"num_inference_steps": 1},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a fox"}],
                modalities=["text", "image"],  # type: ignore[list-item]
                extra_body={**SMALL, **extra},
            )
    not_inline: Any = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    with pytest.raises(openai.BadRequestError, match="data: URL"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": not_inline}]
        )
    broken: Any = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,eA=="}}]
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": broken}],
            modalities=["text", "image"],  # type: ignore[list-item]
            extra_body=SMALL,
        )
