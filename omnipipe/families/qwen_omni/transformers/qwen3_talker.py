"""Qwen3-Omni-MoE's talker on transformers, reproducing the talker part of
Qwen3OmniMoeForConditionalGeneration.generate: a frame per step, its first code the
talker's and the rest its code predictor's, one request's forwards at a time. How the
hand-offs differ from Qwen2.5-Omni's: qwen3.py.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen3_omni
from omnipipe.families.qwen_omni.codec import (
    CodecTalkerSession,
    CodecTalkerStage,
)
from omnipipe.families.qwen_omni.handoff import layout_kwargs
from omnipipe.families.qwen_omni.qwen3 import (
    CHUNK_FRAMES,
    SPECIAL_CODES,
    TALKER_SAMPLING,
    predictor_sampling,
    samples_per_frame,
)
from omnipipe.families.qwen_omni.qwen3_talker_prompt import project_text, talker_prompt
from omnipipe.stagekit.code2wav import SAMPLE_RATE
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Session,
    StageJob,
)


class Qwen3TalkerStage(CodecTalkerStage):
    def load(self) -> None:
        self.model = load_qwen3_omni(self.model_path, self.device, "talker")
        self.talker = self.model.talker
        config = self.model.config
        talker_config = config.talker_config
        if not hasattr(self.talker.config, "audio_config"):
            # transformers' talker rope index reads audio_config.n_window, which the talker
            # config lacks; the audio positions it indexes are the thinker's.
            self.talker.config.audio_config = config.thinker_config.audio_config
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        # A talker code here is a frame: its first code and the code predictor's rest.
        self.chunk_codes = int(self.spec.engine_args.get("chunk_codes", CHUNK_FRAMES))
        self.codes_per_second = SAMPLE_RATE / samples_per_frame(config)
        self.eos = int(talker_config.codec_eos_token_id)
        vocab = int(talker_config.text_config.vocab_size)
        self.suppressed = tuple(
            i for i in range(max(0, vocab - SPECIAL_CODES), vocab) if i != self.eos
        )
        self.groups = int(talker_config.num_code_groups)

    def open(self, job: StageJob) -> Session:
        return Qwen3TalkerSession(self, job.params)


class Qwen3TalkerSession(CodecTalkerSession):
    def __init__(self, stage: Qwen3TalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.predictor_sampling = predictor_sampling(self.sampling)
        self.ahead: deque[torch.Tensor] = deque()  # projected rows the prefill took early
        self.eos_sent = False
        self.past_hidden: torch.Tensor | None = None
        self.code: int | None = None  # the first code of the frame being completed
        self.codes: list[int] = []  # first codes so far, for the repetition penalty
        self.frames: list[list[int]] = []

    @property
    def made(self) -> list[list[int]]:
        return self.frames

    def _project(self, rows: torch.Tensor) -> torch.Tensor:
        return project_text(self.stage.talker, rows)

    def _next_row(self) -> torch.Tensor | None:
        """The next trailing text row; after the thinker's end, tts_eos once, then tts_pad."""
        if self.ahead:
            return self.ahead.popleft()
        if self.replies:
            return self._project(self.replies.popleft())
        if not self.upstream_done:
            return None
        assert self.prompt is not None
        tts = self._project(self.prompt["tts_embeds"])
        if not self.eos_sent:
            self.eos_sent = True
            return tts[1:2]
        return tts[2:3]

    def _choose(self, logits: torch.Tensor) -> bool:
        suppress = self.stage.suppressed
        if len(self.frames) < self.sampling.min_tokens:
            suppress += (self.stage.eos,)
        seen = torch.tensor(self.codes, dtype=torch.long, device=logits.device)
        code = next_token(logits, self.sampling, seen, suppress, self.generator)
        # A frame is completed when its first code is fed back, so the code that ends the
        # answer (eos, or the max_tokens-th as generate() counts) makes no frame.
        if code == self.stage.eos or len(self.frames) + 1 >= self.sampling.max_tokens:
            return True
        self.code = code
        self.codes.append(code)
        return False

    def _prefill(self) -> torch.Tensor:
        from transformers import DynamicCache

        assert self.prompt is not None
        talker, p = self.stage.talker, self.prompt
        device = self.stage.device
        p = {k: v.to(device) for k, v in p.items()}
        prompt = talker_prompt(talker, self.stage.model.config, p, self.replies)
        self.ahead.extend(prompt.ahead)
        codec_part = torch.cat(
            [
                torch.zeros(
                    (len(prompt.rows) - len(prompt.codec_ids), prompt.rows.shape[-1]),
                    device=device,
                    dtype=prompt.rows.dtype,
                ),
                talker.get_input_embeddings()(prompt.codec_ids),
            ]
        )
        embeds = (prompt.rows + codec_part)[None]
        talker_ids = prompt.talker_ids[None]
        self.cache = DynamicCache()
        talker.rope_deltas = None
        out = talker(
            inputs_embeds=embeds,
            talker_input_ids=talker_ids,
            attention_mask=torch.ones_like(talker_ids),
            **layout_kwargs(p),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        self.rope_deltas = talker.rope_deltas
        return self._after(out)

    def _after(self, out: Any) -> torch.Tensor:
        self.past_hidden = out.hidden_states[0][-1][:, -1:]
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _residual_codes(self, code: int) -> tuple[list[int], torch.Tensor]:
        """The frame's other codes from the code predictor, and the summed embedding of all
        of the frame's codes, which is the talker's next input (prepare_inputs_for_generation)."""
        from transformers import DynamicCache

        talker = self.stage.talker
        predictor = talker.code_predictor
        device = self.stage.device
        first = talker.get_input_embeddings()(torch.tensor([[code]], device=device))
        assert self.past_hidden is not None
        cache = DynamicCache()
        total = first[0, 0].clone()
        residual: list[int] = []
        for group in range(self.stage.groups - 1):
            if group == 0:
                inputs: dict[str, Any] = {"inputs_embeds": torch.cat([self.past_hidden, first], 1)}
            else:  # the predictor embeds the previous residual code itself
                inputs = {"input_ids": torch.tensor([[residual[-1]]], device=device)}
            out = predictor(**inputs, past_key_values=cache, use_cache=True, generation_steps=group)
            picked = next_token(
                out.logits[0, -1],
                self.predictor_sampling,
                torch.empty(0, dtype=torch.long),
                generator=self.generator,
            )
            residual.append(picked)
            embedding = predictor.get_input_embeddings()[group]
            total = total + embedding(torch.tensor(picked, device=device))
        return residual, total

    def _forward(self, text: torch.Tensor) -> torch.Tensor:
        assert self.code is not None
        residual, frame_embed = self._residual_codes(self.code)
        self.frames.append([self.code, *residual])
        talker = self.stage.talker
        talker.rope_deltas = self.rope_deltas
        past = self.cache.get_seq_length()
        out = talker(
            inputs_embeds=(frame_embed + text[0])[None, None],
            attention_mask=torch.ones((1, past + 1), dtype=torch.long, device=self.stage.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
            generation_step=len(self.frames) - 1,  # only echoed back by the forward
        )
        return self._after(out)
