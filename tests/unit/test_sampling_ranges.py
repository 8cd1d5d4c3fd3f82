"""BAGEL's sampling extensions and the AR stages' token range have bounds that keep the
math meaningful: a value outside one is an OpenAI-shaped 400 naming the field (`param`),
from the router before any stage runs, and the stages hold the same bounds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import load_file, parse_resource, resolve
from omnipipe.api.families import RequestProblem
from omnipipe.families.bagel.params import flow_params
from omnipipe.families.bagel.ranges import SCALAR_RANGES
from omnipipe.families.bagel.requests import bagel_image_params
from omnipipe.router.api.chat import ChatPlan, ChatRequest
from omnipipe.router.app import build_app
from omnipipe.router.errors import BadRequest
from omnipipe.router.settings import RouterSettings
from omnipipe.stagekit.stage import StageInputError
from tests.unit.test_router_edges import openai_error

REPO = Path(__file__).resolve().parents[2]
BAGEL = resolve(load_file(REPO / "examples/tiny-bagel.yaml"))
OMNI = resolve(load_file(REPO / "examples/tiny-omni.yaml"))

OUT_OF_RANGE = [
    ({"cfg_interval": [1, 0]}, "cfg_interval"),  # start > end: CFG would never apply
    ({"cfg_interval": [0.5, 0.5]}, "cfg_interval"),  # empty
    ({"cfg_interval": [-0.1, 1]}, "cfg_interval"),
    ({"cfg_interval": [0.2, 1.5]}, "cfg_interval"),
    ({"cfg_interval": [0.2]}, "cfg_interval"),
    ({"cfg_interval": "0.2,1"}, "cfg_interval"),
    ({"cfg_interval": [True, 1]}, "cfg_interval"),
    ({"timestep_shift": 0}, "timestep_shift"),
    ({"timestep_shift": 1e-9}, "timestep_shift"),  # a black image
    ({"timestep_shift": 0.5}, "timestep_shift"),
    ({"timestep_shift": 10.5}, "timestep_shift"),
    ({"timestep_shift": -3}, "timestep_shift"),
    ({"cfg_text_scale": 0.5}, "cfg_text_scale"),  # below 1: CFG silently off
    ({"cfg_text_scale": 21}, "cfg_text_scale"),
    ({"cfg_text_scale": "big"}, "cfg_text_scale"),
    ({"cfg_img_scale": 0}, "cfg_img_scale"),
    ({"cfg_img_scale": 1e300}, "cfg_img_scale"),
    ({"cfg_img_scale": 10**400}, "cfg_img_scale"),
    ({"cfg_renorm_min": -0.1}, "cfg_renorm_min"),
    ({"cfg_renorm_min": 1.5}, "cfg_renorm_min"),
    ({"cfg_renorm_min": False}, "cfg_renorm_min"),
]
AT_THE_BOUNDS = [
    {"cfg_interval": [0, 1]},
    {"cfg_interval": [0.999, 1.0]},
    {"timestep_shift": 1},
    {"timestep_shift": 10.0},
    {"cfg_text_scale": 1, "cfg_img_scale": 20},
    {"cfg_renorm_min": 0, "cfg_text_scale": 20},
    {"cfg_renorm_min": 1},
]


@pytest.mark.parametrize(("extra", "param"), OUT_OF_RANGE)
def test_out_of_range_extensions_are_400s_naming_the_field(
    extra: dict[str, Any], param: str
) -> None:
    # The family's RequestProblem; the router answers it as a 400 (the endpoint tests below).
    with pytest.raises(RequestProblem) as err:
        bagel_image_params(extra)
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}: ")
    low, high, _ = SCALAR_RANGES.get(param, (0, 1, None))
    assert f"{low:g}" in err.value.message
    assert f"{high:g}" in err.value.message


@pytest.mark.parametrize(("extra", "param"), OUT_OF_RANGE)
def test_the_stages_hold_the_same_bounds(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(StageInputError) as err:
        flow_params({"width": 64, "height": 64, **extra})
    assert err.value.param == param


@pytest.mark.parametrize("extra", AT_THE_BOUNDS)
def test_values_at_the_bounds_pass_both(extra: dict[str, Any]) -> None:
    params = bagel_image_params(extra)
    for key, value in extra.items():
        assert params[key] == (list(map(float, value)) if key == "cfg_interval" else value)
    flow = flow_params({"width": 64, "height": 64, **params})
    assert flow.cfg_interval == tuple(params["cfg_interval"])
    assert math.isclose(flow.timestep_shift, params["timestep_shift"])


def test_defaults_are_inside_the_bounds() -> None:
    assert bagel_image_params({}) == {
        "cfg_text_scale": 4.0,
        "cfg_img_scale": 1.0,
        "cfg_renorm_min": 0.0,
        "timestep_shift": 3.0,
        "cfg_interval": [0.4, 1.0],
    }


@pytest.fixture
def bagel_client(tmp_path: Path) -> TestClient:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [] for s in BAGEL.stages}))
    settings = RouterSettings(replicas_file=str(replicas), wake_wait_seconds=0)
    return TestClient(build_app(BAGEL, settings), raise_server_exceptions=False)


@pytest.mark.parametrize(("extra", "param"), OUT_OF_RANGE[:8] + OUT_OF_RANGE[12:14])
def test_both_endpoints_answer_an_openai_400_with_param(
    bagel_client: TestClient, extra: dict[str, Any], param: str
) -> None:
    image = bagel_client.post(
        "/v1/images/generations",
        json={"model": BAGEL.name, "prompt": "a fox", "size": "64x64", **extra},
    )
    chat = bagel_client.post(
        "/v1/chat/completions",
        json={
            "model": BAGEL.name,
            "messages": [{"role": "user", "content": "a fox"}],
            "modalities": ["text", "image"],
            "size": "64x64",
            "num_inference_steps": 4,
            **extra,
        },
    )
    for resp in (image, chat):
        error = openai_error(resp, 400)
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"


def test_guidance_scale_is_named_when_it_is_the_text_scale(bagel_client: TestClient) -> None:
    body = {"model": BAGEL.name, "prompt": "a fox", "size": "64x64"}
    error = openai_error(
        bagel_client.post("/v1/images/generations", json={**body, "guidance_scale": 0.5}), 400
    )
    assert error["param"] == "guidance_scale"
    assert "cfg_text_scale: must be from 1 to 20" in error["message"]
    steps = bagel_client.post("/v1/images/generations", json={**body, "num_inference_steps": 1})
    assert openai_error(steps, 400)["param"] == "num_inference_steps"


def omni_with_spec_sampling(sampling: dict[str, int]) -> Any:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "tiny-omni"},
                "spec": {
                    "model": "tiny://qwen2.5-omni",
                    "pipeline": "qwen2.5-omni",
                    "stages": [{"name": "thinker", "sampling": sampling}],
                },
            }
        )
    )


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate(
        {"model": "tiny-omni", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("pipeline", "fields", "param"),
    [
        (
            OMNI,
            {"sampling_params_list": {"thinker": {"min_tokens": 10, "max_tokens": 5}}},
            "sampling_params_list.thinker.min_tokens",
        ),
        (
            OMNI,
            {"max_tokens": 5, "sampling_params_list": [{"min_tokens": 10}]},
            "sampling_params_list.thinker.min_tokens",
        ),
        (
            OMNI,
            {"sampling_params_list": {"talker": {"min_tokens": 10, "max_tokens": 9}}},
            "sampling_params_list.talker.min_tokens",
        ),
        (omni_with_spec_sampling({"min_tokens": 10}), {"max_tokens": 5}, "max_tokens"),
        (
            omni_with_spec_sampling({"min_tokens": 10}),
            {"max_completion_tokens": 5},
            "max_completion_tokens",
        ),
        (
            omni_with_spec_sampling({"max_tokens": 5}),
            {"sampling_params_list": {"thinker": {"min_tokens": 6}}},
            "sampling_params_list.thinker.min_tokens",
        ),
    ],
)
def test_min_tokens_past_max_tokens_is_a_400_naming_the_field_sent(
    pipeline: Any, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as err:
        ChatPlan(pipeline, chat(**fields))
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}: ")


def test_min_tokens_up_to_max_tokens_passes() -> None:
    plan = ChatPlan(
        omni_with_spec_sampling({"min_tokens": 5}),
        chat(max_tokens=5, sampling_params_list={"talker": {"min_tokens": 3, "max_tokens": 3}}),
    )
    assert plan.params["thinker"]["sampling"]["max_tokens"] == 5


@pytest.mark.parametrize("guidance", [0, 0.5, 1])
def test_a_negative_prompt_that_cfg_would_ignore_is_a_400(tmp_path: Path, guidance: float) -> None:
    """Qwen-Image's true CFG runs above 1 only: below, the negative prompt did nothing."""
    image = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [] for s in image.stages}))
    settings = RouterSettings(replicas_file=str(replicas), wake_wait_seconds=0)
    body = {"model": image.name, "prompt": "a fox", "size": "64x64", "guidance_scale": guidance}
    with TestClient(build_app(image, settings), raise_server_exceptions=False) as client:
        error = openai_error(
            client.post("/v1/images/generations", json={**body, "negative_prompt": "blurry"}),
            400,
        )
        assert error["param"] == "guidance_scale"
        assert "above 1" in error["message"]
        # Without one there is no CFG to miss: the request passes the checks (503: no
        # replica here).
        assert client.post("/v1/images/generations", json=body).status_code == 503
