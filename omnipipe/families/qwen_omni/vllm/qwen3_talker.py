"""Qwen3-Omni's talker on vLLM: the MoE talker in vLLM's continuous batch, its code
predictor run inside the forward for every answer that feeds a first code back
(qwen3_frames.py). The prompt, its rows and rope positions are built by the same code as
the transformers talker's (qwen3_talker_prompt.talker_prompt), which stays the reference
(tests/unit/test_vllm_talker.py holds the frames equal).

The stage keeps transformers' text and hidden projections (the feed's rows are talker
rows) and its rope index; the talker's decoder layers are dropped from that copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnipipe.families.qwen_omni.checkpoint import load_qwen3_omni
from omnipipe.families.qwen_omni.handoff import layout_kwargs
from omnipipe.families.qwen_omni.qwen3 import (
    CHUNK_FRAMES,
    SPECIAL_CODES,
    TALKER_SAMPLING,
    predictor_sampling,
    samples_per_frame,
)
from omnipipe.families.qwen_omni.qwen3_talker_prompt import project_text, talker_prompt
from omnipipe.families.qwen_omni.vllm.qwen3_frames import FrameState, Qwen3FrameFeed
from omnipipe.families.qwen_omni.vllm.talker import VllmTalkerBase, VllmTalkerSession
from omnipipe.stagekit.code2wav import SAMPLE_RATE, chunk_codes
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import Session, StageJob
from omnipipe.stagekit.vllm.feed import RowFeed


class VllmQwen3TalkerStage(VllmTalkerBase):
    architecture = "OmnipipeQwen3OmniTalker"
    model_class = "omnipipe.families.qwen_omni.vllm.qwen3_talker_model:Qwen3OmniTalkerForVllm"
    feed: Qwen3FrameFeed

    def configure(self, config: Any) -> None:
        self.full_config = config
        talker_config = config.talker_config
        self.groups = int(talker_config.num_code_groups)
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        self.chunk_codes = chunk_codes(self.spec.engine_args, CHUNK_FRAMES)
        self.codes_per_second = SAMPLE_RATE / samples_per_frame(config)
        eos = int(talker_config.codec_eos_token_id)
        vocab = int(talker_config.text_config.vocab_size)
        self.stop_codes = frozenset({eos})
        # generate() suppresses the codec specials (the top ids) except eos.
        self.allowed = [i for i in range(vocab) if i < vocab - SPECIAL_CODES or i == eos]
        self.pad = int(talker_config.codec_pad_id)
        model = load_qwen3_omni(self.model_path, self.device, "talker")
        self.talker = model.talker
        self.talker.model.layers = nn.ModuleList()  # vLLM runs the decoder
        if not hasattr(self.talker.config, "audio_config"):
            # As the transformers stage: the rope index reads the thinker's audio config.
            self.talker.config.audio_config = config.thinker_config.audio_config

    def make_feed(self) -> RowFeed:
        return Qwen3FrameFeed(self.groups)

    def open(self, job: StageJob) -> Session:
        return Qwen3TalkerSession(self, job.params)


class Qwen3TalkerSession(VllmTalkerSession):
    stage: VllmQwen3TalkerStage

    def __init__(self, stage: VllmQwen3TalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        predictor = predictor_sampling(self.sampling)
        self.frames = FrameState(0, predictor, self.sampling.generator(stage.device))

    @property
    def made(self) -> list[list[int]]:  # type: ignore[override]
        """The frames so far: each first code fed back, with the predictor's codes."""
        start = self.frames.frames_from
        out = []
        for i, code in enumerate(self.codes):
            rest = self.frames.codes.get(start + i)
            if rest is None:
                break
            out.append([code, *rest])
        return out

    def _prepare(self) -> None:
        stage, p = self.stage, self.prompt
        assert p is not None
        talker = stage.talker
        with torch.inference_mode():
            prompt = talker_prompt(talker, stage.full_config, p, self.replies)
            talker.rope_deltas = None
            positions = talker.compute_3d_position_ids(
                prompt.rows[None],
                talker_input_ids=prompt.talker_ids[None],
                attention_mask=torch.ones_like(prompt.talker_ids[None]),
                **_rope_layout(p),
            )
        self.positions = positions[:, 0].cpu()
        self.delta = int(talker.rope_deltas.reshape(-1)[0])
        length = len(prompt.rows)
        self.rows = [prompt.rows.cpu(), *(row.cpu() for row in prompt.ahead)]
        codec = [int(c) for c in prompt.codec_ids]
        self.codec_prompt = [stage.pad] * (length - len(codec)) + codec
        self.codec_from = length - len(codec)
        self.frames.frames_from = length

    def _row(self, reply: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return project_text(self.stage.talker, reply).cpu()

    def _tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.prompt is not None
        with torch.inference_mode():
            tts = project_text(self.stage.talker, self.prompt["tts_embeds"]).cpu()
        return tts[1], tts[2]

    def _before_submit(self) -> None:
        if self.codes:
            # The last code the previous request made was never fed back: its frame is
            # made now, from the state that request's last forward left.
            position = self.frames.frames_from + len(self.codes) - 1
            if position not in self.frames.codes:
                self.stage.feed.complete(self.frames, position, self.codes[-1])

    def _track(self, engine_id: str) -> None:
        self.stage.feed.track(engine_id, self.frames)


def _rope_layout(p: dict[str, torch.Tensor]) -> dict[str, Any]:
    layout = layout_kwargs(p)
    return {
        "image_grid_thw": layout["image_grid_thw"],
        "video_grid_thw": layout["video_grid_thw"],
        "use_audio_in_video": layout["use_audio_in_video"],
        "audio_feature_lengths": layout["audio_feature_lengths"],
        "video_second_per_grid": layout["video_second_per_grid"],
    }
