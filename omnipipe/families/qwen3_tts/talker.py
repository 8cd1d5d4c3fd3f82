"""Qwen3-TTS's talker on transformers: the request's text to codec frames, one frame a
step (its first code the talker's, the other fifteen its code predictor's), sent to
code2wav a chunk of frames at a time. The first stage of its pipeline: it reads the
request, not an upstream stage.

Sampling follows qwen-tts's generate(): the checkpoint's generation_config.json
defaults, at least two frames' worth of tokens before the end may be chosen, the codec's
specials suppressed, the request's seed drawing the talker's and the predictor's choices
in the reference's order."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnipipe.families.qwen3_tts.clips import reference_clip
from omnipipe.families.qwen3_tts.config import (
    CHUNK_FRAMES,
    PREFIX_CODES,
    SPECIAL_CODES,
    TTSConfig,
    read_config,
)
from omnipipe.families.qwen3_tts.prompt import (
    Prompt,
    Voice,
    assistant_text,
    instruction_text,
    prompt_embeds,
    reference_text,
)
from omnipipe.families.qwen3_tts.reference_codes import ReferenceCodes
from omnipipe.families.qwen3_tts.speaker_encoder import SpeakerEncoder
from omnipipe.families.qwen3_tts.talker_model import TalkerModel, checkpoint_weights
from omnipipe.families.qwen3_tts.voice_prompts import prompt_of
from omnipipe.families.qwen3_tts.voices import UPLOADED_CLIP, voice_of
from omnipipe.stagekit.code2wav import SAMPLE_RATE, chunk_codes
from omnipipe.stagekit.params import int_param
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepOutcome,
    StepResult,
    StreamingStage,
)

MIN_TOKENS = 2  # generate() forces min_new_tokens=2
CLIPS = 256  # reference clips whose x-vectors (a few KB) and codes (94 KB a minute) are kept
FIRST = "initial_codec_chunk_frames"
# Prompt rows besides the text's own tokens: the codec's tags, the speaker, an instruction
# (counted separately when asked for), tts_eos and the start row; a bound, not exact.
PROMPT_TAGS = 8


@dataclasses.dataclass(frozen=True)
class EncodedClip:
    """What a reference clip gives a cloned voice: its x-vector, and its codes once a
    request has cloned it in context."""

    x_vector: torch.Tensor
    codes: torch.Tensor | None = None


def talker_sampling(generate: dict[str, Any]) -> Sampling:
    return Sampling(
        temperature=float(generate["temperature"]) if generate["do_sample"] else 0.0,
        top_p=float(generate["top_p"]),
        top_k=int(generate["top_k"]),
        max_tokens=int(generate["max_new_tokens"]),
        repetition_penalty=float(generate["repetition_penalty"]),
    )


def predictor_sampling(generate: dict[str, Any], greedy_asked: bool) -> Sampling:
    """The code predictor's: the checkpoint's subtalker_* settings (independent of the
    talker's, as in qwen-tts), greedy too when a request asks for temperature 0: the
    request API has one temperature, and greedy speech means greedy frames."""
    greedy = greedy_asked or not generate["subtalker_dosample"]
    return Sampling(
        temperature=0.0 if greedy else float(generate["subtalker_temperature"]),
        top_p=float(generate["subtalker_top_p"]),
        top_k=int(generate["subtalker_top_k"]),
    )


class TalkerStage(StreamingStage):
    def load(self) -> None:
        from transformers import Qwen2Tokenizer

        self.config: TTSConfig = read_config(self.model_path)
        model = TalkerModel(self.config)
        model.load_checkpoint(self.model_path)
        self.model = model.to(self.device).eval()
        self.speaker_encoder: SpeakerEncoder | None = None
        self.reference_codes: ReferenceCodes | None = None
        self.clips: OrderedDict[bytes, EncodedClip] = OrderedDict()
        if self.config.kind == "base":
            encoder = SpeakerEncoder(self.config.speaker_encoder)
            encoder.load_checkpoint(self.model_path, checkpoint_weights(Path(self.model_path)))
            self.speaker_encoder = encoder.to(self.device).eval()
            self.reference_codes = ReferenceCodes(self.model_path).to(self.device).eval()
        self.tokenizer = Qwen2Tokenizer.from_pretrained(self.model_path)
        self.sampling = Sampling.from_params(
            talker_sampling(self.config.generate), self.spec.sampling
        )
        if self.sampling.max_tokens < MIN_TOKENS:
            raise ValueError(
                f"sampling.max_tokens: at least {MIN_TOKENS} for a Qwen3-TTS talker (the last "
                f"code chosen makes no frame), not {self.sampling.max_tokens}"
            )
        self.chunk_codes = chunk_codes(self.spec.engine_args, CHUNK_FRAMES)
        eos, vocab = self.config.eos, self.config.vocab
        self.suppressed = tuple(i for i in range(vocab - SPECIAL_CODES, vocab) if i != eos)

    def preset_voices(self) -> list[str]:
        return list(self.config.speakers)

    def voice_prompt(self, clip: str, reference_text: str | None) -> dict[str, Any]:
        if self.speaker_encoder is None or self.reference_codes is None:
            raise NotImplementedError(
                f"a {self.config.kind} model speaks no cloned voice; a Base model does"
            )
        samples = reference_clip(clip)
        codes = self.reference_codes.codes(samples) if reference_text is not None else None
        return prompt_of(self.speaker_encoder.x_vector(samples), codes)

    def token_ids(self, text: str) -> torch.Tensor:
        ids: torch.Tensor = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return ids.to(self.device)

    def prepare(self, job: StageJob) -> None:
        """A Base request's reference clip, hashed and (unless it is kept encoded)
        decoded off the engine thread: up to a minute of audio, sent as base64."""
        clip = job.params.get("ref_audio") or job.params.get(UPLOADED_CLIP)
        if self.speaker_encoder is None or not isinstance(clip, str) or not clip:
            return
        key = hashlib.sha256(clip.encode()).digest()
        job.prepared = (key, None if key in self.clips else reference_clip(clip))

    def open(self, job: StageJob) -> Session:
        return TalkerSession(self, job.params, job.prepared)

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """The sessions that complete a frame have their code predictors run as one batch
        (fifteen forwards for them all, not fifteen each); then each steps its talker."""
        framing = [s for s, _ in work if isinstance(s, TalkerSession) and s.completes_frame()]
        if len(framing) > 1:
            hidden, codes = [], []
            for session in framing:
                assert session.past_hidden is not None
                assert session.code is not None
                hidden.append(session.past_hidden)
                codes.append(session.code)
            try:
                with torch.inference_mode():
                    picked, embeds = self.model.frames(
                        torch.cat(hidden), codes, [s.predictor_pick() for s in framing]
                    )
            except Exception as exc:  # the batch's failure is each of its sessions'
                for session in framing:
                    session.framed = exc
            else:
                for i, session in enumerate(framing):
                    session.framed = (picked[i], embeds[i : i + 1])
        return super().step_sessions(work)

    def cloned(self, voice: Voice, prepared: Any = None) -> Voice:
        """A Base request's voice with its reference clip's x-vector (and its codes, in
        context), made once for the last CLIPS clips seen (an uploaded voice is sent with
        every request that names it). `prepared`: prepare()'s (clip hash, samples or None
        when kept)."""
        if voice.reference_clip is None:
            return voice
        assert self.speaker_encoder is not None
        assert self.reference_codes is not None
        key, samples = prepared or (hashlib.sha256(voice.reference_clip.encode()).digest(), None)
        encoded = self.clips.pop(key, None)
        if encoded is None or (voice.reference_text is not None and encoded.codes is None):
            if samples is None:
                samples = reference_clip(voice.reference_clip)
            if encoded is None:
                encoded = EncodedClip(self.speaker_encoder.x_vector(samples))
            if voice.reference_text is not None:
                encoded = dataclasses.replace(encoded, codes=self.reference_codes.codes(samples))
        self.clips[key] = encoded
        while len(self.clips) > CLIPS:
            self.clips.popitem(last=False)
        codes = encoded.codes if voice.reference_text is not None else None
        return dataclasses.replace(
            voice, reference_clip=None, x_vector=encoded.x_vector, reference_codes=codes
        )


class TalkerSession(Session):
    def __init__(self, stage: TalkerStage, params: dict[str, Any], prepared: Any = None) -> None:
        self.stage = stage
        config = stage.config
        text = params.get("input")
        if not isinstance(text, str) or not text.strip():
            raise StageInputError("input: a non-empty string is required", "input")
        voice = voice_of(config, params)
        sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        sampling = sampling.with_request_seed(params)
        # generate() forces two codes before the end may be chosen: a request's own
        # min_tokens is raised to that, and a max below it cannot be met.
        if sampling.max_tokens < MIN_TOKENS:
            raise StageInputError(
                f"max_new_tokens: at least {MIN_TOKENS} (the last code chosen makes no "
                f"frame), not {sampling.max_tokens}",
                "max_new_tokens",
            )
        self.sampling = dataclasses.replace(
            sampling, min_tokens=max(sampling.min_tokens, MIN_TOKENS)
        )
        asked = params.get("sampling") or {}
        self.predictor = predictor_sampling(config.generate, asked.get("temperature") == 0)
        self.generator = self.sampling.generator(stage.device)
        first = params.get("initial_codec_chunk_frames")
        self.first_chunk = stage.chunk_codes if first is None else int_param(params, FIRST, 0)
        if self.first_chunk < 1:
            raise StageInputError(f"{FIRST}: at least 1 frame, not {self.first_chunk}", FIRST)
        self.text_ids = stage.token_ids(assistant_text(text))
        self.instruction_ids = (
            stage.token_ids(instruction_text(voice.instruction)) if voice.instruction else None
        )
        self.reference_ids = (
            stage.token_ids(reference_text(voice.reference_text))
            if voice.reference_text is not None
            else None
        )
        # Each frame is one position in the talker's cache, past the prompt's.
        prompt = self.text_ids.shape[1] + PROMPT_TAGS
        for ids in (self.instruction_ids, self.reference_ids):
            prompt += 0 if ids is None else ids.shape[1]
        self._check_room(prompt, "this input")
        # Last: a request refused above costs no speaker encoding.
        self.voice: Voice = stage.cloned(voice, prepared)
        if self.voice.reference_codes is not None:  # the clip's frames sit in the prompt too
            self._check_room(prompt + len(self.voice.reference_codes), "this input and clip")
        self.cache: Any = None
        self.length = 0  # positions in the talker's cache
        self.past_hidden: torch.Tensor | None = None
        self.prompt: Prompt | None = None
        self.code: int | None = None  # the first code of the frame being completed
        self.codes: list[int] = []  # first codes so far, for the repetition penalty
        self.frames: list[list[int]] = []
        self.sent = 0
        # The frame the stage's batch completed for this step, or why it could not.
        self.framed: tuple[list[int], torch.Tensor] | Exception | None = None

    def _check_room(self, prompt: int, what: str) -> None:
        room = self.stage.config.max_positions - prompt
        if self.sampling.max_tokens > room:
            raise StageInputError(
                f"max_new_tokens: at most {room} for {what} (the talker's "
                f"{self.stage.config.max_positions} positions), not {self.sampling.max_tokens}",
                "max_new_tokens",
            )

    def completes_frame(self) -> bool:
        """Its next step completes the frame of a first code chosen (not its prompt's)."""
        return self.cache is not None and self.code is not None

    def predictor_pick(self) -> Any:
        return self._pick(self.predictor, [], ())

    def _pick(self, sampling: Sampling, seen: list[int], suppress: tuple[int, ...]) -> Any:
        def pick(logits: torch.Tensor) -> int:
            already = torch.tensor(seen, dtype=torch.long, device=logits.device)
            return next_token(logits, sampling, already, suppress, self.generator)

        return pick

    def _choose(self, logits: torch.Tensor) -> bool:
        """The next first code; True when it ends the speech (end of speech, or the
        max_tokens-th, which makes no frame: a frame is made when its code is fed back)."""
        suppress = self.stage.suppressed
        if len(self.codes) < self.sampling.min_tokens:
            suppress += (self.stage.config.eos,)
        code = self._pick(self.sampling, self.codes, suppress)(logits)
        self.codes.append(code)
        if code == self.stage.config.eos or len(self.codes) >= self.sampling.max_tokens:
            return True
        self.code = code
        return False

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        from transformers import DynamicCache

        model = self.stage.model
        first = self.cache is None
        with torch.inference_mode():
            if first:
                self.prompt = prompt_embeds(
                    model,
                    self.stage.config,
                    self.text_ids,
                    self.instruction_ids,
                    self.voice,
                    # qwen-tts's default for each kind: generate_voice_clone streams the
                    # text in, the other generate functions give it whole.
                    streaming_text=self.stage.config.kind == "base",
                    reference_ids=self.reference_ids,
                )
                self.cache = DynamicCache()
                self.past_hidden, logits = model.forward_rows(self.prompt.rows, self.cache, 0)
                self.length = self.prompt.rows.shape[1]
            else:
                assert self.code is not None
                assert self.past_hidden is not None
                assert self.prompt is not None
                framed, self.framed = self.framed, None
                if isinstance(framed, Exception):
                    raise framed
                rest, frame = framed or model.frame(
                    self.past_hidden, self.code, self.predictor_pick()
                )
                row = self.prompt.step_row(len(self.frames))
                self.frames.append([self.code, *rest])
                self.past_hidden, logits = model.forward_rows(frame + row, self.cache, self.length)
                self.length += 1
        result = self._emit(self._choose(logits))
        if first:  # the speech's usage counts the input's tokens (under SSE)
            result.outputs.append({"prompt_tokens": int(self.text_ids.shape[1])})
        return result

    def _emit(self, done: bool) -> StepResult:
        due = self.first_chunk if self.sent == 0 else self.stage.chunk_codes
        if len(self.frames) - self.sent < due and not done:
            return StepResult()
        chunk = self.frames[self.sent :]
        tensors = {"codes": torch.tensor(chunk, dtype=torch.long)} if chunk else {}
        if self.sent == 0 and self.voice.reference_codes is not None:
            tensors[PREFIX_CODES] = self.voice.reference_codes
        self.sent = len(self.frames)
        return StepResult(
            tensors=tensors,
            done=done,
            audio_seconds=len(chunk) * self.stage.config.samples_per_frame / SAMPLE_RATE,
        )

    def close(self) -> None:
        self.cache = None
