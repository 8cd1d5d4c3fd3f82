"""Qwen3-Omni-MoE as three streaming stages, reproducing
Qwen3OmniMoeForConditionalGeneration.generate: thinker -> talker -> code2wav.

Differences from Qwen2.5-Omni that shape the hand-offs:
- The talker projects the thinker's states itself (text_projection, hidden_projection), so
  the thinker sends raw embeddings, plus one mid-layer hidden state for media positions.
- The talker's prompt is the user turns and the first reply token; every later reply token
  is one "trailing text" row, consumed one per codec frame, then tts_eos, then tts_pad.
- A codec frame is num_code_groups codes: the talker picks the first, its code predictor
  the rest. code2wav is causal and deterministic.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen3_omni
from omnipipe.families.qwen_omni.codec import (
    SAMPLE_RATE,
    ChunkedCode2WavSession,
    ChunkedCode2WavStage,
    CodecTalkerSession,
    CodecTalkerStage,
    Decode,
)
from omnipipe.families.qwen_omni.qwen3_talker_prompt import project_text, talker_prompt
from omnipipe.families.qwen_omni.transformers.thinker import (
    HiddenStates,
    ThinkerStage,
    layout_kwargs,
    media_layout,
    pick_voice,
)
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Session,
    StageJob,
    Tensors,
)

# transformers' defaults (Qwen3OmniMoeForConditionalGeneration.generate).
TALKER_SAMPLING = Sampling(
    temperature=0.9, top_p=1.0, top_k=50, max_tokens=4096, repetition_penalty=1.05
)
# The code predictor samples with fixed top-k/top-p, greedy when the talker is greedy.
PREDICTOR_SAMPLING = Sampling(temperature=1.0, top_p=0.8, top_k=50)
CHUNK_FRAMES = 25  # talker -> code2wav chunk: 2 s of audio at 12.5 frames/s
CONTEXT_FRAMES = 25  # as transformers' chunked_decode: left context decoded again
# generate() suppresses the top 1024 ids of the talker's vocabulary (codec specials).
SPECIAL_CODES = 1024


def samples_per_frame(config: Any) -> int:
    c2w = config.code2wav_config
    samples = 1
    for rate in (*c2w.upsample_rates, *c2w.upsampling_ratios):
        samples *= int(rate)
    return samples


def voices(config: Any) -> list[str]:
    """Speaker names; the checkpoint keys them in lower case."""
    return [name.capitalize() for name in config.talker_config.speaker_id]


# ---- thinker --------------------------------------------------------------------------


class Qwen3ThinkerStage(ThinkerStage):
    def load_model(self) -> Any:
        return load_qwen3_omni(self.model_path, self.device, "thinker")

    @property
    def speaker_map(self) -> dict[str, Any]:
        return {}  # Qwen3-Omni keeps speakers in the config, not in a separate file

    @property
    def voices(self) -> list[str]:
        return voices(self.config)

    def talker_prompt(self, inputs: Tensors, hidden: HiddenStates, voice: str) -> Tensors:
        config = self.config
        specials = torch.tensor(
            [[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]],
            device=inputs["input_ids"].device,
        )
        prompt: Tensors = {
            "input_ids": inputs["input_ids"][0],
            "prompt_embeds": hidden[0][0],
            "prompt_hidden": hidden[config.talker_config.accept_hidden_layer][0],
            "tts_embeds": self.embed(specials)[0],
            "speaker_id": torch.tensor([config.talker_config.speaker_id[voice.lower()]]),
        }
        return {**prompt, **media_layout(inputs)}

    def reply_row(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden[0][0, -1:]


# ---- talker ---------------------------------------------------------------------------


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
        self.predictor_sampling = (
            dataclasses.replace(PREDICTOR_SAMPLING, temperature=0.0)
            if self.sampling.temperature == 0
            else PREDICTOR_SAMPLING
        )
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


# ---- code2wav -------------------------------------------------------------------------


class Qwen3Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_qwen3_omni(self.model_path, self.device, "code2wav")
        self.code2wav = self.model.code2wav
        self.samples_per_frame = samples_per_frame(self.model.config)
        self.voices = voices(self.model.config)
        args = self.spec.engine_args
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_FRAMES))
        self.context_codes = int(args.get("context_codes", CONTEXT_FRAMES))

    def open(self, job: StageJob) -> Session:
        pick_voice(job.params, self.voices)  # the talker speaks it; a bad one fails early
        return Qwen3Code2WavSession(self)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks as one batch through the (deterministic) decoder."""
        if len(decodes) == 1:
            return super().decode_many(sessions, decodes)
        # frames x groups each -> batch x groups x frames
        waveforms = self.code2wav(torch.stack([d.codes.T for d in decodes]))
        skip = decodes[0].context * self.samples_per_frame
        audio = waveforms[..., skip:].reshape(len(decodes), -1).float().cpu()
        return [row.numpy() for row in audio]


class Qwen3Code2WavSession(ChunkedCode2WavSession):
    """Decodes as transformers' chunked_decode does, so the audio equals its output."""

    def __init__(self, stage: Qwen3Code2WavStage) -> None:
        super().__init__(stage)
        self.stage = stage

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        waveform = self.stage.code2wav(codes.T[None])  # frames x groups -> 1 x groups x frames
        audio = waveform[..., context * self.stage.samples_per_frame :].reshape(-1)
        decoded: np.ndarray = audio.float().cpu().numpy()
        return decoded
