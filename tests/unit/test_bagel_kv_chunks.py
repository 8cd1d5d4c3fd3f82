"""A context longer than one engine step's token budget (chunked prefill) on its own
vLLM engine: in its own module, as two in-process engines share vLLM's global state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.bagel.context import Turn, image_contexts
from omnipipe.families.bagel.image import BagelGenerateStage
from omnipipe.families.bagel.think import BagelThinkStage
from omnipipe.stagekit.vllm.kv import OmnipipeKVExport
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_bagel_stages import IMAGE, KV_ATOL, MODEL, one_process_prefill, think
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(300)


def test_a_prefill_in_chunks_exports_the_whole_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A context longer than one engine step's token budget is prefilled over several
    steps (chunked prefill): the connector collects every chunk's slots."""
    path = resolve_model_path(MODEL)
    args = {"max_model_len": 512, "max_num_batched_tokens": 64, "enable_chunked_prefill": True}
    s = spec("think", Role.THINKER, MODEL, engine_args=args).model_copy(
        update={"engine": Engine.VLLM}
    )
    stage = stage_class(s, path)(s, path, "cpu")
    stage.load()
    assert isinstance(stage, BagelThinkStage)
    prompt = "a red fox in the snow " * 8  # 176 bytes: three chunks of 64
    chunks: list[int] = []
    take = OmnipipeKVExport.take

    def counting_take(self: OmnipipeKVExport, request_id: str) -> Any:
        chunks.append(len(self._saved[request_id].chunks[0]))
        return take(self, request_id)

    monkeypatch.setattr(OmnipipeKVExport, "take", counting_take)
    caches = think(stage, {**IMAGE, "prompt": prompt, "cfg_text_scale": 1.0}).caches()
    assert chunks == [3]  # layer 0's cache came in three steps
    context = image_contexts([Turn("user", (prompt,))], [], False, False)["full"].text
    generate = BagelGenerateStage(spec("generate", Role.DENOISER, MODEL), path, "cpu")
    generate.load()
    reference = one_process_prefill(generate, stage.tokenizer, context)
    assert reference.length > 128
    torch.testing.assert_close(caches["full"].keys, reference.keys, atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(caches["full"].values, reference.values, atol=KV_ATOL, rtol=0)
