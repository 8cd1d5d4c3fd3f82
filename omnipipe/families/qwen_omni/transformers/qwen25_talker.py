"""Qwen2.5-Omni as three streaming stages, reproducing
Qwen2_5OmniForConditionalGeneration.generate: thinker -> talker -> code2wav.

The thinker streams text to the router and, per generated token, the hidden state the
talker consumes; the talker starts on the first of them and sends codec codes in chunks;
code2wav turns each chunk into audio (re-decoding a little left context for continuity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen25_omni
from omnipipe.families.qwen_omni.codec import (
    SAMPLE_RATE,
    ChunkedCode2WavSession,
    ChunkedCode2WavStage,
    CodecTalkerSession,
    CodecTalkerStage,
    Decode,
    seed_of,
)
from omnipipe.families.qwen_omni.qwen25_token2wav import starting_noise, synthesize
from omnipipe.families.qwen_omni.transformers.thinker import layout_kwargs, pick_voice
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Session,
    StageJob,
)

# transformers' defaults (Qwen2_5OmniForConditionalGeneration.generate).
TALKER_SAMPLING = Sampling(
    temperature=0.9, top_p=0.8, top_k=40, max_tokens=4096, repetition_penalty=1.05
)
CHUNK_CODES = 25  # talker -> code2wav chunk: half a second of audio at 50 codes/s
CONTEXT_CODES = 25  # left context code2wav decodes again so chunks join smoothly


def samples_per_code(config: Any) -> int:
    """Audio samples one codec code becomes: mel frames per code x vocoder upsampling."""
    t2w = config.token2wav_config
    samples = int(t2w.dit_config.repeats)
    for rate in t2w.bigvgan_config.upsample_rates:
        samples *= int(rate)
    return samples


# ---- talker ---------------------------------------------------------------------------


class TalkerStage(CodecTalkerStage):
    def load(self) -> None:
        self.model = load_qwen25_omni(self.model_path, self.device, "talker")
        self.talker = self.model.talker
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        self.codes_per_second = SAMPLE_RATE / samples_per_code(self.model.config)
        self.chunk_codes = int(self.spec.engine_args.get("chunk_codes", CHUNK_CODES))
        # transformers stops the talker on the codec pad or end token.
        self.stop_codes = frozenset({self.talker.codec_pad_token, self.talker.codec_eos_token})

    def open(self, job: StageJob) -> Session:
        return TalkerSession(self, job.params)


class TalkerSession(CodecTalkerSession):
    def __init__(self, stage: TalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.tail: torch.Tensor | None = None  # the text-eos then text-pad rows, once drained
        self.seen: list[int] = []
        self.codes: list[int] = []

    @property
    def made(self) -> list[int]:
        return self.codes

    def _next_row(self) -> torch.Tensor | None:
        """The thinker's next reply row; after its end, text-eos once, then text-pad."""
        if self.replies:
            return self.replies.popleft()
        if not self.upstream_done:
            return None
        assert self.prompt is not None
        if self.tail is None:
            self.tail = self.prompt["text_pad_embed"][None]
            return self.prompt["text_eos_embed"][None]
        return self.tail

    def _choose(self, logits: torch.Tensor) -> bool:
        talker = self.stage.talker
        seen = torch.tensor(self.seen + self.codes, dtype=torch.long, device=logits.device)
        suppress: tuple[int, ...] = (talker.codec_bos_token,)
        if len(self.codes) < self.sampling.min_tokens:
            suppress += tuple(self.stage.stop_codes)
        code = next_token(logits, self.sampling, seen, suppress, self.generator)
        if code in self.stage.stop_codes:
            return True
        self.codes.append(code)
        return len(self.codes) >= self.sampling.max_tokens

    def _prefill(self) -> torch.Tensor:
        from transformers import DynamicCache

        assert self.prompt is not None
        talker, p = self.stage.talker, self.prompt
        device = self.stage.device
        input_ids = p["input_ids"][None].to(device)
        first_token_row = self.replies.popleft()
        length = input_ids.shape[1]
        text_ids = torch.cat(
            [input_ids, p["text_bos_id"][None].to(device), p["first_token_id"][None].to(device)],
            dim=1,
        )
        codec_ids = torch.tensor(
            [[talker.codec_mask_token] * length + [talker.codec_pad_token, talker.codec_bos_token]],
            device=device,
        )
        self.seen = codec_ids[0].tolist()
        dtype = talker.thinker_to_talker_proj.weight.dtype
        embeds = torch.cat([p["prompt_embeds"], p["text_bos_embed"][None], first_token_row], dim=0)[
            None
        ].to(device, dtype)
        self.cache = DynamicCache()
        talker.rope_deltas = None
        out = talker(
            input_ids=codec_ids,
            input_text_ids=text_ids,
            inputs_embeds=embeds,
            attention_mask=torch.ones_like(codec_ids),
            **layout_kwargs(p),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.rope_deltas = talker.rope_deltas
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _forward(self, row: torch.Tensor) -> torch.Tensor:
        talker = self.stage.talker
        device = self.stage.device
        talker.rope_deltas = self.rope_deltas
        past = self.cache.get_seq_length()
        out = talker(
            input_ids=torch.tensor(
                [[self.codes[-1] if self.codes else self.seen[-1]]], device=device
            ),
            thinker_reply_part=row[None].to(device, talker.thinker_to_talker_proj.weight.dtype),
            attention_mask=torch.ones((1, past + 1), dtype=torch.long, device=device),
            past_key_values=self.cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[0, -1]
        return logits


# ---- code2wav -------------------------------------------------------------------------


class Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_qwen25_omni(self.model_path, self.device, "token2wav")
        self.token2wav = self.model.token2wav
        self.samples_per_code = samples_per_code(self.model.config)
        args = self.spec.engine_args
        self.num_steps = int(args.get("num_steps", 10))
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_CODES))
        self.context_codes = int(args.get("context_codes", CONTEXT_CODES))

    def open(self, job: StageJob) -> Session:
        return Code2WavSession(self, job.params)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks through one DiT sampling and one vocoder pass: each
        keeps its own voice and starting noise, so its audio is what it gets alone."""
        own = [s for s in sessions if isinstance(s, Code2WavSession)]
        assert len(own) == len(sessions), "sessions of another stage"
        if len(decodes) == 1 or len({s.reference_mel.shape for s in own}) > 1:
            # Alone, or voices whose reference mels differ in length (no shipped pair
            # does): transformers' own path, one at a time.
            return super().decode_many(sessions, decodes)
        codes = torch.stack([d.codes for d in decodes])
        waveforms = synthesize(
            self.token2wav,
            torch.cat([s.conditioning for s in own]),
            torch.cat([s.reference_mel for s in own]),
            codes,
            torch.cat([s.noise(len(d.codes)) for s, d in zip(own, decodes, strict=True)]),
            self.num_steps,
        )
        new = (codes.shape[1] - decodes[0].context) * self.samples_per_code
        return [w[-new:].float().cpu().numpy() for w in waveforms]


class Code2WavSession(ChunkedCode2WavSession):
    def __init__(self, stage: Code2WavStage, params: dict[str, Any]) -> None:
        super().__init__(stage)
        self.stage = stage
        speaker = stage.model.speaker_map[pick_voice(params, list(stage.model.speaker_map))]
        self.conditioning = speaker["cond"].to(stage.device).float()
        self.reference_mel = speaker["ref_mel"].to(stage.device).float()
        self.seed = seed_of(params)

    def noise(self, codes: int) -> torch.Tensor:
        """This chunk's starting noise, from the seed _decode sets."""
        seed = None if self.seed is None else self.seed + self.decoded
        return starting_noise(
            self.stage.token2wav.code2wav_dit_model, codes, seed, self.stage.device
        )

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        if self.seed is not None:
            # token2wav starts from noise: the same codes and seed give the same audio.
            torch.manual_seed(self.seed + self.decoded)
        waveform = self.stage.token2wav(
            codes[None],
            conditioning=self.conditioning,
            reference_mel=self.reference_mel,
            num_steps=self.stage.num_steps,
        ).reshape(-1)
        new = (len(codes) - context) * self.stage.samples_per_code
        audio: np.ndarray = waveform[-new:].float().cpu().numpy()
        return audio
