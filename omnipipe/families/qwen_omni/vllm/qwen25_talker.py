"""Qwen2.5-Omni's talker on vLLM (the model: qwen25_talker_model.py; what every Qwen Omni
talker on vLLM shares: talker.py). Its codec prompt is mask ids over the thinker's
prompt rows, then pad and bos over text-bos and the first reply row; a reply row is the
thinker's, as sent; after the reply come text-eos once and text-pad for ever."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.qwen_omni.handoff import layout_kwargs
from omnipipe.families.qwen_omni.qwen25 import (
    CHUNK_CODES,
    TALKER_SAMPLING,
    samples_per_code,
)
from omnipipe.families.qwen_omni.vllm.talker import VllmTalkerBase, VllmTalkerSession
from omnipipe.stagekit.code2wav import SAMPLE_RATE, chunk_codes
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import Session, StageJob


class RopeIndex:
    """transformers' talker rope index (it reads only the config), without the model."""

    def __init__(self, config: Any) -> None:
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        owner = m.Qwen2_5OmniPreTrainedModelForConditionalGeneration
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self._index = owner.get_rope_index
        self.get_llm_pos_ids_for_vision = owner.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = owner.get_chunked_index.__get__(self)

    def __call__(self, text_ids: torch.Tensor, layout: dict[str, Any]) -> tuple[torch.Tensor, int]:
        positions, deltas = self._index(
            self,  # type: ignore[arg-type]  # reads only config and spatial_merge_size
            text_ids[None],  # type: ignore[arg-type]
            layout["image_grid_thw"],
            layout["video_grid_thw"],
            torch.ones_like(text_ids[None]),
            layout["use_audio_in_video"],
            layout["audio_feature_lengths"],
            layout["video_second_per_grid"],
        )
        return positions[:, 0], int(deltas.reshape(-1)[0])


class VllmTalkerStage(VllmTalkerBase):
    """Qwen2.5-Omni's talker on vLLM."""

    architecture = "OmnipipeQwen25OmniTalker"
    model_class = "omnipipe.families.qwen_omni.vllm.qwen25_talker_model:Qwen25OmniTalkerForVllm"

    def configure(self, config: Any) -> None:
        self.config = config.talker_config
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        self.codes_per_second = SAMPLE_RATE / samples_per_code(config)
        self.chunk_codes = chunk_codes(self.spec.engine_args, CHUNK_CODES)
        c = self.config
        self.stop_codes = frozenset({c.tts_codec_pad_token_id, c.tts_codec_end_token_id})
        # Every code but codec-bos, as transformers' talker suppresses it.
        self.allowed = [i for i in range(c.vocab_size) if i != c.tts_codec_start_token_id]
        self.rope_index = RopeIndex(c)

    def open(self, job: StageJob) -> Session:
        return Qwen25TalkerSession(self, job.params)


class Qwen25TalkerSession(VllmTalkerSession):
    stage: VllmTalkerStage

    def _prepare(self) -> None:
        """The codec prompt (mask ids, then pad and bos, whose embeddings are added) and
        its rows: the thinker's prompt rows, text-bos and the first reply row."""
        stage, p = self.stage, self.prompt
        assert p is not None
        c = stage.config
        length = int(p["input_ids"].shape[0])
        text_ids = torch.cat([p["input_ids"], p["text_bos_id"], p["first_token_id"]])
        self.positions, self.delta = stage.rope_index(text_ids, layout_kwargs(p))
        self.rows = [p["prompt_embeds"], p["text_bos_embed"][None]]
        self.codec_prompt = [c.tts_codec_mask_token_id] * length + [
            c.tts_codec_pad_token_id,
            c.tts_codec_start_token_id,
        ]
        self.codec_from = length

    def _row(self, reply: torch.Tensor) -> torch.Tensor:
        return reply

    def _tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.prompt is not None
        return self.prompt["text_eos_embed"], self.prompt["text_pad_embed"]
