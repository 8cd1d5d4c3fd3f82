"""The router's edges: every error in OpenAI's shape (unknown routes, wrong methods and
bugs included), the body limit without a Content-Length, the OpenAPI document's request
schemas, and extreme values that must be 400s."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnipipe.api import load_file, resolve
from omnipipe.api.constants import SERVER_KEEP_ALIVE_SECONDS, UPSTREAM_KEEP_ALIVE_SECONDS
from omnipipe.router.api.chat import ChatPlan, ChatRequest
from omnipipe.router.api.images import parse_size
from omnipipe.router.app import build_app
from omnipipe.router.errors import BadRequest
from omnipipe.router.settings import RouterSettings

REPO = Path(__file__).resolve().parents[2]
IMAGE = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))
OMNI = resolve(load_file(REPO / "examples/tiny-omni.yaml"))
LIMIT = 4096


def app_for(tmp_path: Path, pipeline: str = "image", **settings: Any) -> FastAPI:
    resolved = IMAGE if pipeline == "image" else OMNI
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [] for s in resolved.stages}))
    values = {"replicas_file": str(replicas), "wake_wait_seconds": 0, "max_body_bytes": LIMIT}
    return build_app(resolved, RouterSettings(**{**values, **settings}))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as c:
        yield c


def openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


def test_unknown_routes_and_wrong_methods_are_openai_shaped(client: TestClient) -> None:
    error = openai_error(client.post("/v1/nothing-here", json={}), 404)
    assert error["message"] == "Invalid URL (POST /v1/nothing-here)"
    assert error["type"] == "invalid_request_error"
    openai_error(client.get("/"), 404)
    wrong = client.get("/v1/images/generations")
    error = openai_error(wrong, 405)
    assert error["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"
    openai_error(client.delete("/v1/models"), 405)


def test_a_bug_is_a_500_in_openai_shape(tmp_path: Path) -> None:
    app = app_for(tmp_path)

    @app.get("/v1/broken")
    async def broken() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as c:
        error = openai_error(c.get("/v1/broken"), 500)
    assert error["type"] == "server_error"
    assert "a bug" not in error["message"]  # internals stay in the log


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/chat/completions"])
def test_a_body_of_millions_of_members_is_refused_before_anything_parses_it(
    tmp_path: Path, path: str
) -> None:
    """25 MB of `"k1":1,"k2":1,...` is under the size limit, but parsing and validating
    its two million members held the router's loop for seconds. It is refused as it
    arrives, by its count of commas and colons; a body just under that count is parsed."""
    members = 2_000_000
    huge = b'{"model":"nope"' + b"".join(b',"k%d":1' % i for i in range(members)) + b"}"
    under = b'{"model":"nope","a":[' + b"1," * 99_990 + b"1]}"
    with TestClient(
        app_for(tmp_path, max_body_bytes=25 * 1024 * 1024), raise_server_exceptions=False
    ) as c:
        started = time.process_time()
        refused = c.post(path, content=huge, headers={"content-type": "application/json"})
        spent = time.process_time() - started
        # A form's type skips the count only where forms are read: here it is JSON anyway.
        as_form = c.post(path, content=huge, headers={"content-type": "multipart/form-data"})
        read = c.post(path, content=under, headers={"content-type": "application/json"})
    for answer in (refused, as_form):
        error = openai_error(answer, 400)
        assert "over 100000 commas and colons" in error["message"]
    # Counting is a few ms of C; json.loads and pydantic took over 3 s of CPU here.
    assert spent < 1.0, spent
    # Read and parsed: what it lacks is named.
    assert openai_error(read, 400)["param"] in {"prompt", "messages"}


def test_chunked_body_over_the_limit_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-image", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    resp = client.post(
        "/v1/images/generations", content=chunks(), headers={"content-type": "application/json"}
    )
    error = openai_error(resp, 413)
    assert str(LIMIT) in error["message"]
    # Under the limit, a chunked body is read as usual.
    small = client.post(
        "/v1/images/generations",
        content=iter([b'{"model": "nope", ', b'"prompt": "x"}']),
    )
    assert openai_error(small, 404)["code"] == "model_not_found"


def test_unknown_paths_share_one_metric_series(client: TestClient) -> None:
    for i in range(3):
        client.post(f"/v1/made-up-{i}")
    metrics = client.get("/metrics").text
    assert 'route="unmatched"' in metrics
    assert "made-up" not in metrics
    assert 'route="/v1/models"' not in metrics
    client.get("/v1/models")
    assert 'route="/v1/models"' in client.get("/metrics").text


def test_openapi_describes_every_request_body(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    posts = {
        p: ops["post"] for p, ops in document["paths"].items() if "post" in ops and p[:4] == "/v1/"
    }
    assert set(posts) == {
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/chat/completions",
        "/v1/audio/speech",
        "/v1/omni/generate",
    }
    for path, operation in posts.items():
        # The image edit is OpenAI's multipart form; every other body is JSON.
        kind = "multipart/form-data" if path == "/v1/images/edits" else "application/json"
        schema = operation["requestBody"]["content"][kind]["schema"]
        model = schemas[schema["$ref"].removeprefix("#/components/schemas/")]
        assert "model" in model["required"], path
        assert model["properties"], path
    # The admin calls' one body, and the control calls they name.
    admin = document["paths"]["/admin/{action}"]["post"]
    body = admin["requestBody"]["content"]["application/json"]["schema"]
    assert {"$ref": "#/components/schemas/AdminCall"} in body["anyOf"]
    action = next(p for p in admin["parameters"] if p["name"] == "action")
    assert {"pause", "sleep", "start_profile", "reset_prefix_cache"} <= set(
        action["schema"]["enum"]
    )
    # Every reference resolves within the document.
    for ref in _refs(document):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    chat = schemas["ChatRequest"]["properties"]
    assert chat["messages"]["items"]["properties"]["role"]["enum"]
    image = schemas["ImageGenerationRequest"]["properties"]
    assert image["n"]["maximum"] == 10
    assert image["output_format"]["enum"] == ["png", "jpeg", "webp"]
    assert image["background"]["enum"] == ["auto", "opaque", "transparent"]
    edit = schemas["ImageEditRequest"]
    # One file or several (image[]), as many as the model edits with.
    assert edit["properties"]["image"]["type"] == "array"
    assert edit["properties"]["image"]["items"]["format"] == "binary"
    assert {"model", "image", "prompt"} <= set(edit["required"])


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@pytest.mark.parametrize(
    "size",
    ["9" * 5000 + "x64", "64x" + "1" * 5000, "0" * 4000 + "64x64", "64x64\n"],
    ids=["wide", "tall", "zeros", "newline"],
)
def test_sizes_with_thousands_of_digits_are_400_at_once(size: str) -> None:
    started = time.thread_time()  # CPU time: a loaded machine does not stretch it
    with pytest.raises(BadRequest, match="size"):
        parse_size(size)
    assert time.thread_time() - started < 0.1


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate(
        {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 5e-324}, "top_p"),
        ({"top_p": 1e-300}, "top_p"),
        ({"temperature": 5e-324}, "temperature"),
        ({"sampling_params_list": {"talker": {"top_p": 5e-324}}}, "sampling_params_list.talker"),
        (
            {"sampling_params_list": {"thinker": {"repetition_penalty": 1e-310}}},
            "sampling_params_list.thinker",
        ),
    ],
)
def test_values_that_round_to_zero_in_an_engine_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        ChatPlan(OMNI, chat(**fields))
    assert err.value.param is not None
    assert err.value.param.startswith(param)
    assert "at least 1e-06" in err.value.message


def test_greedy_and_ordinary_values_still_pass() -> None:
    plan = ChatPlan(OMNI, chat(temperature=0, top_p=1e-6, max_tokens=65536))
    assert plan.params["thinker"]["sampling"] == {
        "temperature": 0,
        "top_p": 1e-6,
        "max_tokens": 65536,
    }


@pytest.mark.parametrize(
    "body",
    ids=lambda body: body[:60],
    argvalues=[
        '{"top_p": NaN}',
        '{"temperature": Infinity}',
        '{"temperature": -Infinity}',
        '{"top_p": 1e999}',
        '{"max_tokens": 1e999}',
        '{"max_tokens": 99999999999999999999999999999}',
        '{"max_tokens": ' + "9" * 5000 + "}",
        '{"seed": ' + "9" * 5000 + "}",
        '{"sampling_params_list": {"thinker": {"temperature": NaN}}}',
        '{"sampling_params_list": {"talker": {"top_p": Infinity}}}',
        '{"sampling_params_list": {"talker": {"max_tokens": ' + "9" * 5000 + "}}}",
        '{"sampling_params_list": [{"top_k": 1e999}]}',
    ],
)
def test_extreme_values_in_a_chat_body_are_400(tmp_path: Path, body: str) -> None:
    fields = body[1:]
    raw = '{"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], ' + fields
    with TestClient(
        app_for(tmp_path, "omni", max_body_bytes=1 << 20), raise_server_exceptions=False
    ) as c:
        resp = c.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
    openai_error(resp, 400)


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 10**40},
        {"num_inference_steps": 10**6},
        {"guidance_scale": float("inf")},
        {"size": "1" * 3000 + "x16"},
        {"seed": -1},
    ],
)
def test_extreme_image_values_are_400(client: TestClient, fields: dict[str, Any]) -> None:
    body = json.dumps({"model": "tiny-image", "prompt": "x", **fields})
    resp = client.post(
        "/v1/images/generations", content=body, headers={"content-type": "application/json"}
    )
    openai_error(resp, 400)


def test_idle_connections_close_on_the_client_side_first() -> None:
    """A client that keeps an idle connection longer than its server does can send a
    request the instant the server closes it, and the request fails as a lost replica
    (uvicorn's default is 5 s against aiohttp's 15 s: the likeliest cause of a CI run's
    'stage thinker failed: its replica went away'). The router's pool to the workers
    lets one go first, and the servers outlast the common clients' defaults."""
    assert UPSTREAM_KEEP_ALIVE_SECONDS < SERVER_KEEP_ALIVE_SECONDS
    openai_client_expiry = httpx.Limits(max_connections=1).keepalive_expiry  # httpx's default
    assert openai_client_expiry is not None
    assert openai_client_expiry < SERVER_KEEP_ALIVE_SECONDS
    load_balancer_idle_seconds = 60  # a cloud load balancer's default (AWS's ALB)
    assert load_balancer_idle_seconds < SERVER_KEEP_ALIVE_SECONDS


BIG = "m" * 1_000_000
NAME = "@name"  # the pipeline's own name, filled in per case


CHAT = "/v1/chat/completions"
ECHOES = [
    ("image", CHAT, {"model": BIG, "messages": [{"role": "user", "content": "x"}]}),
    ("omni", CHAT, {"model": BIG, "messages": [{"role": "user", "content": "x"}]}),
    ("omni", CHAT, {"model": NAME, "messages": [{"role": BIG, "content": "x"}]}),
    ("omni", CHAT, {"model": NAME, "messages": [{"role": "user", "content": [{"type": BIG}]}]}),
    ("image", "/v1/images/generations", {"model": BIG, "prompt": "x"}),
    ("image", "/v1/images/generations", {"model": NAME, "prompt": "x", "size": BIG}),
    ("omni", "/v1/audio/speech", {"model": BIG, "input": "x"}),
    ("image", "/v1/omni/generate", {"model": BIG, "prompt": "x"}),
    ("omni", "/v1/omni/generate", {"model": BIG, "prompt": "x"}),
]


@pytest.mark.parametrize(
    ("pipeline", "path", "body"),
    ECHOES,
    ids=[
        "chat-model-image",
        "chat-model-omni",
        "chat-role",
        "chat-part",
        "image-model",
        "image-size",
        "speech",
        "generate-image",
        "generate-omni",
    ],
)
def test_a_megabyte_value_is_not_echoed_back(
    tmp_path: Path, pipeline: str, path: str, body: dict[str, Any]
) -> None:
    """A client's value quoted in an error is cut short: a 1 MB model name answers in
    under 2 KB, still naming the field and starting with the value."""
    name = IMAGE.name if pipeline == "image" else OMNI.name
    body = json.loads(json.dumps(body).replace('"@name"', json.dumps(name)))
    app = app_for(tmp_path, pipeline, max_body_bytes=4 * 1024 * 1024)
    with TestClient(app, raise_server_exceptions=False) as c:
        resp = c.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text[:500]
    assert len(resp.content) < 2500, resp.text[:500]
    assert "mmmm" in openai_error(resp, resp.status_code)["message"]


@pytest.mark.parametrize(
    ("pipeline", "path", "field", "value"),
    [
        ("omni", CHAT, "max_tokens", "10"),
        ("omni", CHAT, "max_tokens", True),
        ("omni", CHAT, "temperature", "0.5"),
        ("omni", CHAT, "seed", 1.5),
        ("image", "/v1/images/generations", "n", "2"),
        ("image", "/v1/images/generations", "num_inference_steps", True),
        ("image", "/v1/images/generations", "guidance_scale", "4"),
        ("image", "/v1/omni/generate", "seed", "7"),
    ],
)
def test_a_number_sent_as_text_or_a_boolean_is_a_400_naming_the_field(
    tmp_path: Path, pipeline: str, path: str, field: str, value: Any
) -> None:
    """OpenAI's API refuses "10" and true where a number belongs; so does the router,
    instead of reading them as 10 and 1."""
    name = IMAGE.name if pipeline == "image" else OMNI.name
    body: dict[str, Any] = {"model": name, field: value}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    with TestClient(app_for(tmp_path, pipeline, max_body_bytes=1 << 20)) as c:
        error = openai_error(c.post(path, json=body), 400)
    assert error["param"] == field, error
    assert "valid" in error["message"], error


def test_sampling_overrides_take_numbers_only(tmp_path: Path) -> None:
    body = {
        "model": OMNI.name,
        "messages": [{"role": "user", "content": "x"}],
        "sampling_params_list": {"thinker": {"max_tokens": "8"}},
    }
    with TestClient(app_for(tmp_path, "omni", max_body_bytes=1 << 20)) as c:
        error = openai_error(c.post(CHAT, json=body), 400)
    assert error["param"] == "sampling_params_list.thinker.max_tokens", error
