"""BAGEL's KV hand-off, per request, on tiny://bagel: what the think stage hands the
generate stage (the context's KV cache and its CFG companions, as KV blocks) in bytes, the
time to take it out of vLLM (the KV connector's export, through collective_rpc) and pack
it into blocks, and to send it over omnipipe's tcp transfer into a receiver's BlockTable,
beside the anchor: a re-prefill of the same
contexts by the generate stage's own modules, the work the hand-off replaces (one
torch thread; the tiny model's prefill is cheap, so at this size the anchor is small and
the ratio says little about a 7B model, whose prefill grows far faster than its cache
bytes). Medians;
ratios are against the anchor. An image-edit request (an input image, text and image CFG:
three contexts) and a text-to-image one with a long prompt (two contexts, one empty).

The bytes for BAGEL-7B-MoT (28 layers, 4 KV heads of 128, bf16) are computed from the
measured token counts, not measured.

    .venv/bin/python bench/bagel_kv.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from _common import median, record, table
from PIL import Image

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.bagel import think as bagel_think
from omnipipe.families.bagel.image import BagelGenerateStage
from omnipipe.families.bagel.kv_blocks import BLOCK_TOKENS, LAYOUT
from omnipipe.families.bagel.reference import prefill_text
from omnipipe.families.bagel.think import BagelThinkStage
from omnipipe.stagekit.stage import StageJob
from omnipipe.transfer import BlockTable, Mailbox, Message, make_receiver, make_sender
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import spec

BAGEL_7B_BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2  # layers x (K, V) x heads x dim x bf16


def _image() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (0, 0, 255)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


CASES: dict[str, dict[str, Any]] = {
    "edit (3 contexts)": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "data": _image()}, {"type": "text", "text": "red"}],
            }
        ],
        "cfg_text_scale": 4.0,
        "cfg_img_scale": 2.0,
    },
    "t2i, 300-byte prompt": {"prompt": "a red fox in the snow " * 14, "cfg_text_scale": 4.0},
}


def load() -> tuple[BagelThinkStage, BagelGenerateStage]:
    model = "tiny://bagel"
    path = resolve_model_path(model)
    stages = []
    for name, role, engine, args in (
        ("think", Role.THINKER, Engine.VLLM, {"max_model_len": 1024}),
        ("generate", Role.DENOISER, Engine.DIFFUSERS, {}),
    ):
        s = spec(name, role, model, engine_args=args).model_copy(update={"engine": engine})
        stage = stage_class(s, path)(s, path, "cpu")
        stage.load()
        stages.append(stage)
    think, generate = stages
    assert isinstance(think, BagelThinkStage)
    assert isinstance(generate, BagelGenerateStage)
    return think, generate


def hand_off(
    think: BagelThinkStage, params: dict[str, Any]
) -> tuple[dict[str, Any], list[torch.Tensor], float]:
    """One request's think session; returns its tensors, its KV blocks and the export's
    seconds (taking the caches out of vLLM and packing them into blocks)."""
    spent = 0.0
    original = think.take_cache

    def timed(engine_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal spent
        start = time.perf_counter()
        try:
            return original(engine_id)
        finally:
            spent += time.perf_counter() - start

    original_pack = bagel_think.pack

    def timed_pack(caches: Any, dtype: torch.dtype) -> Any:
        nonlocal spent
        start = time.perf_counter()
        try:
            return original_pack(caches, dtype)
        finally:
            spent += time.perf_counter() - start

    think.take_cache = timed  # type: ignore[method-assign]
    bagel_think.pack = timed_pack
    blocks: list[torch.Tensor] = []
    try:
        session = think.open(StageJob(params={"image": True, **params}, inputs={}))
        tensors: dict[str, Any] = {}
        while True:
            step = session.step([])
            if step is not None:
                tensors.update(step.tensors)
                blocks.extend(step.blocks)
                if step.done:
                    break
        session.close()
    finally:
        think.take_cache = original  # type: ignore[method-assign]
        bagel_think.pack = original_pack
    return tensors, blocks, spent


async def send_times(messages: list[Message], table: BlockTable) -> list[float]:
    """Each message sent to a receiver that takes its blocks into `table` (the generate
    worker's), until it is in the mailbox; its rows are then given back."""
    mailbox = Mailbox()
    receiver = make_receiver("tcp", mailbox, credential="bench", block_table=table)
    await receiver.start()
    sender = make_sender("tcp", credential="bench")
    times = []
    try:
        for message in messages:
            start = time.perf_counter()
            await sender.send(receiver.address, message)
            received = await mailbox.get(message.request_id)
            times.append(time.perf_counter() - start)
            table.free(received.block_ids)
    finally:
        await sender.close()
        await receiver.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few requests")
    n = 5 if parser.parse_args().quick else 30
    quick = n == 5
    think, generate = load()
    rows, results = [], {}
    for name, params in CASES.items():
        exports: list[float] = []
        tensors: dict[str, Any] = {}
        blocks: list[torch.Tensor] = []
        for _ in range(n):
            tensors, blocks, spent = hand_off(think, params)
            exports.append(spent)
        nbytes = sum(b.numel() * b.element_size() for b in blocks)
        tokens = int(tensors[LAYOUT][:, 1].sum())
        message = [Message(f"r{i}", "think", tensors, blocks=blocks) for i in range(n)]
        sends = asyncio.run(send_times(message, generate.kv_block_table()))
        # The anchor: the generate stage re-prefilling the text contexts itself (the
        # edit case's image context would also need the ViT: its text part stands in).
        texts = [p.text for p in _contexts(params)]
        # One thread, as vLLM runs its engine here: two spinning OpenMP threads on a
        # shared 2-core machine made a 300-token prefill 60x slower.
        torch.set_num_threads(1)
        prefills = []
        for _ in range(n):
            start = time.perf_counter()
            for text in texts:
                prefill_text(generate.generator, think.tokenizer, text)
            prefills.append(time.perf_counter() - start)
        export_ms, send_ms, prefill_ms = (1e3 * median(v) for v in (exports, sends, prefills))
        rows.append(
            [
                name,
                str(tokens),
                f"{nbytes / 1024:.1f}",
                f"{tokens * BAGEL_7B_BYTES_PER_TOKEN / 2**20:.1f}",
                f"{export_ms:.2f}",
                f"{send_ms:.2f}",
                f"{prefill_ms:.2f}",
                f"{(export_ms + send_ms) / prefill_ms:.2f}x",
            ]
        )
        results[name] = {
            "tokens": tokens,
            "kv_bytes": nbytes,
            "bagel_7b_bytes": tokens * BAGEL_7B_BYTES_PER_TOKEN,
            "export_ms_p50": export_ms,
            "send_ms_p50": send_ms,
            "reprefill_ms_p50": prefill_ms,
        }
    print(
        table(
            [
                "request",
                "KV tokens",
                f"KiB in {BLOCK_TOKENS}-token blocks (tiny)",
                "MiB (7B, computed)",
                "export+pack ms",
                "tcp send into block table ms",
                "anchor: re-prefill ms",
                "hand-off / anchor",
            ],
            rows,
        )
    )
    record("bagel_kv", results, quick)


def _contexts(params: dict[str, Any]) -> list[Any]:
    from omnipipe.families.bagel.context import image_contexts
    from omnipipe.families.bagel.think import conversation

    turns, images = conversation(params)
    text_cfg = float(params.get("cfg_text_scale", 4.0)) > 1
    image_cfg = float(params.get("cfg_img_scale", 1.0)) > 1
    contexts = image_contexts(turns, images, text_cfg, image_cfg)
    return [p for p in contexts.values() if p.text]


if __name__ == "__main__":
    main()
