"""LoRA adapters under `omnipipe serve`, through the official openai client: /v1/models
lists each adapter; naming one as the model applies it (the same image as the `lora`
field at its scale); scale 0 is the base image; two concurrent requests with different
adapters each get their own image; bad adapter requests are OpenAI-shaped 4xx."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from omnipipe.families.qwen_image.tiny_lora import save_tiny_lora
from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    ink = save_tiny_lora(tmp_module / "ink", seed=1)
    neon = save_tiny_lora(tmp_module / "neon", seed=2)
    adapters = (
        "  adapters:\n"
        f"    - {{name: ink, source: {ink}, stage: denoise}}\n"
        f"    - {{name: neon, source: {neon}, stage: denoise, scale: 0.5}}\n"
    )
    s = start_serve(write_pipeline(tmp_module, "styled", adapters))
    yield s
    stop_cleanly(s)


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        yield c


def image(client: openai.OpenAI, model: str, **extra: Any) -> bytes:
    r = client.images.generate(
        model=model,
        prompt="a lighthouse",
        size="64x64",
        extra_body={"num_inference_steps": 3, "seed": 7, **extra},
    )
    return base64.b64decode(r.data[0].b64_json or "")


def test_models_lists_each_adapter_beside_the_pipeline(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"styled", "ink", "neon"}
    assert models["neon"].model_extra == {
        "root": models["neon"].model_extra["root"],
        "parent": "styled",
        "pipeline": "qwen-image",
    }
    assert models["neon"].model_extra["root"].endswith("/neon")


def test_an_adapter_named_as_the_model_applies_at_its_scale(client: openai.OpenAI) -> None:
    base = image(client, "styled")
    ink = image(client, "ink")
    neon = image(client, "neon")
    assert len({base, ink, neon}) == 3
    assert image(client, "styled", lora={"name": "ink"}) == ink
    assert image(client, "styled", lora={"name": "neon", "scale": 0.5}) == neon
    assert image(client, "neon", lora={"name": "neon", "scale": 1.0}) != neon
    assert image(client, "ink", lora={"name": "ink", "scale": 0}) == base


def test_concurrent_requests_with_other_adapters_each_get_their_own(
    client: openai.OpenAI,
) -> None:
    alone = {m: image(client, m) for m in ("ink", "neon", "styled")}
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda m: (m, image(client, m)), [*alone, *alone]))
    for model, got in together:
        assert got == alone[model], model


@pytest.mark.parametrize(
    ("model", "extra", "status", "param"),
    [
        ("styled", {"lora": {"name": "sketch"}}, 400, "lora.name"),
        ("ink", {"lora": {"name": "neon"}}, 400, "lora.name"),
        ("styled", {"lora": {"name": "ink", "scale": 99}}, 400, "lora.scale"),
        ("styled", {"lora": {"name": "ink", "weight": 1}}, 400, "lora.weight"),
        ("styled", {"lora": "ink"}, 400, "lora"),
        ("sketch", {}, 404, "model"),
    ],
)
def test_a_bad_adapter_request_is_an_openai_shaped_4xx(
    client: openai.OpenAI, model: str, extra: dict[str, Any], status: int, param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        image(client, model, **extra)
    assert err.value.status_code == status
    body: Any = err.value.body
    assert body["param"] == param, body


async def test_the_python_api_applies_an_adapter_as_the_images_endpoint_does(
    served: Served, client: openai.OpenAI
) -> None:
    from omnipipe import AsyncOmni

    expected = image(client, "neon")
    async with AsyncOmni(base_url=served.base_url.removesuffix("/v1")) as omni:
        got = [
            out.image
            async for out in omni.generate(
                "a lighthouse", size="64x64", num_inference_steps=3, seed=7, lora={"name": "neon"}
            )
            if out.image
        ]
    assert got == [expected]


async def test_the_python_api_lists_the_adapters(served: Served) -> None:
    from omnipipe import AsyncOmni

    async with AsyncOmni(base_url=served.base_url.removesuffix("/v1")) as omni:
        assert await omni.list_loras() == ["ink", "neon"]
