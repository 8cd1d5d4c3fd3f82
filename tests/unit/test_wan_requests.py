"""A /v1/videos request as Wan's stage parameters: the frame count made from seconds and
fps, and each field outside what the model takes refused with the field named; and a
video pipeline's router refusing to start without the Redis its jobs live in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.families import RequestProblem
from omnipipe.families.wan.requests import EXTENSIONS
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings


def test_defaults_are_wans_480p_five_seconds_at_16_fps() -> None:
    assert EXTENSIONS.video_params({"prompt": "x"}) == {
        "width": 832,
        "height": 480,
        "fps": 16,
        "num_frames": 81,
        "num_inference_steps": 50,
        "guidance_scale": 5.0,
        "negative_prompt": "",
    }


@pytest.mark.parametrize(
    ("fields", "frames"),
    [
        ({"seconds": "4", "fps": 16}, 65),
        ({"seconds": 1, "fps": 8}, 9),
        ({"seconds": "0.5", "fps": 8}, 5),
        # Multipart sends every field as text.
        ({"seconds": "2", "fps": "8", "num_frames": "13"}, 13),
    ],
)
def test_the_frame_count_is_4k_plus_1(fields: dict[str, Any], frames: int) -> None:
    assert EXTENSIONS.video_params(fields)["num_frames"] == frames


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"size": "832x481"}, "size", "multiples of 16"),
        ({"size": "2048x1024"}, "size", "from 16 to 1280"),
        ({"size": "big"}, "size", "must look like 832x480"),
        ({"num_frames": 12}, "num_frames", r"4k\+1 \(1, 5, 9"),
        ({"num_frames": 261}, "num_frames", "between 1 and 257"),
        ({"num_frames": 8.5}, "num_frames", "must be an integer"),
        ({"seconds": "100"}, "seconds", "between"),
        ({"seconds": "nan"}, "seconds", "must be a number"),
        # float() and int() read these; a client sending them sent no plain number.
        ({"num_inference_steps": "1_0"}, "num_inference_steps", "must be a number"),
        ({"num_inference_steps": " 1 "}, "num_inference_steps", "must be a number"),
        ({"num_frames": "\u0665"}, "num_frames", "must be a number"),
        ({"size": "\uff11\uff16x\uff11\uff16"}, "size", "must look like 832x480"),
        ({"seconds": "soon"}, "seconds", "must be a number"),
        ({"fps": 0}, "fps", "between 1 and 60"),
        # Past a float: JSON carries integers of any length.
        ({"fps": 10**400}, "fps", "must be a number"),
        ({"num_inference_steps": 500}, "num_inference_steps", "between 1 and 200"),
        ({"guidance_scale": -1}, "guidance_scale", "between 0 and 50"),
        ({"negative_prompt": 3}, "negative_prompt", "must be a string"),
    ],
)
def test_what_the_model_cannot_take_is_refused_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestProblem, match=words) as err:
        EXTENSIONS.video_params(fields)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        # Each side and the frame count inside its own bound: 416,000 latent tokens.
        (
            {"size": "1280x1280", "num_frames": 257},
            "num_frames",
            "1280x1280 at 257 frames is 416,000 latent tokens, past the limit of 147,600",
        ),
        ({"size": "1280x1280", "seconds": 10}, "seconds", "past the limit of 147,600"),
        # 1280x720 at 81 frames is 75,600 tokens: 97 steps at most.
        (
            {"size": "1280x720", "num_inference_steps": 98},
            "num_inference_steps",
            "7,408,800 token-steps, past the limit of 7,380,000 .*take at most 97 steps",
        ),
    ],
)
def test_a_job_past_the_work_bound_is_refused_before_it_is_made(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestProblem, match=words) as err:
        EXTENSIONS.video_params(fields)
    assert err.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"size": "1280x720", "num_frames": 161},  # the bound itself
        {"size": "1280x720", "num_inference_steps": 97},
        {"num_frames": 257},  # 832x480's longest
        {"num_inference_steps": 200},  # 832x480 at 81 frames, the steps' own bound
    ],
)
def test_the_work_bound_leaves_wans_own_settings_alone(fields: dict[str, Any]) -> None:
    EXTENSIONS.video_params(fields)


def test_images_and_chat_images_are_refused_with_the_endpoint_to_use() -> None:
    with pytest.raises(RequestProblem, match="POST /v1/videos"):
        EXTENSIONS.image_params({"prompt": "x"})


def test_a_video_pipelines_router_needs_its_store(tmp_path: Path) -> None:
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "v"},
                "spec": {"model": "tiny://wan", "pipeline": "wan"},
            }
        )
    )
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"stages": {s.name: [] for s in pipeline.stages}}))
    with pytest.raises(ValueError, match="set OMNIPIPE_ROUTER_VIDEO_STORE"):
        build_app(pipeline, RouterSettings(replicas_file=str(replicas)))
    app = build_app(
        pipeline,
        RouterSettings(replicas_file=str(replicas), video_store="redis://127.0.0.1:1/0"),
    )
    assert "/v1/videos/{video_id}/content" in {getattr(r, "path", "") for r in app.routes}
