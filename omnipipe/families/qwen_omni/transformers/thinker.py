"""The thinker of the Qwen Omni families on transformers: it streams text to the router
and, per generated token, the hidden state the talker consumes. The first chunk it sends
also carries the talker's prompt package (see talker_prompt).

What the stage hands the talker depends only on `config`, `embed` (the thinker's input
embedding table) and `speaker_map`, so another engine (families/qwen_omni/vllm/thinker.py) can
reuse talker_prompt and reply_row around its own forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen25_omni
from omnipipe.stagekit.chat_media import (
    ChatMedia,
    processor_media,
    processor_options,
    processor_warnings_silenced,
)
from omnipipe.stagekit.media import charge_media, decode_image, decode_wav
from omnipipe.stagekit.media_limits import EffectiveMedia, effective_media
from omnipipe.stagekit.replies import THINKER_SAMPLING, ReplyText
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepResult,
    StreamingStage,
    Tensors,
    refusal_message,
)
from omnipipe.stagekit.video import decode_video

DEFAULT_VOICE = "Chelsie"
# transformers' hidden_states tuple (0: embeddings, -1: final), or the layers of it that
# another engine captured, keyed the same way.
HiddenStates = tuple[torch.Tensor, ...] | Mapping[int, torch.Tensor]

# transformers' defaults (Qwen2_5OmniForConditionalGeneration.generate).
MEDIA_KINDS = ("image", "audio", "video")


# The processor outputs the talker's rope index reads (see media_layout).
LAYOUT_INPUTS = (
    "image_grid_thw",
    "video_grid_thw",
    "video_second_per_grid",
    "use_audio_in_video",
    "feature_attention_mask",
)


def media_layout(inputs: Tensors) -> Tensors:
    """What the talker's rope index needs of the prompt's media: image and video grids, the
    video's seconds per grid, audio lengths, and whether the video's audio is interleaved."""
    layout: Tensors = {}
    for key in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
        if key in inputs:
            layout[key] = inputs[key]
    if "video_grid_thw" in inputs and "use_audio_in_video" in inputs:
        layout["use_audio_in_video"] = inputs["use_audio_in_video"]
    if "feature_attention_mask" in inputs:
        layout["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(-1)
    return layout


def layout_kwargs(layout: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """media_layout as the talker's forward takes it (and the thinker's rope index)."""
    return {
        "image_grid_thw": layout.get("image_grid_thw"),
        "video_grid_thw": layout.get("video_grid_thw"),
        "video_second_per_grid": layout.get("video_second_per_grid"),
        "use_audio_in_video": bool(layout["use_audio_in_video"])
        if "use_audio_in_video" in layout
        else False,
        "audio_feature_lengths": layout.get("audio_feature_lengths"),
    }


def rope_index(thinker: Any) -> Any:
    """The thinker's 3D rope index: on its text model from transformers 5.21, on the thinker
    itself before (vLLM 0.32 pins transformers below 5.20)."""
    return getattr(thinker.model, "get_rope_index", None) or thinker.get_rope_index


def pick_voice(params: dict[str, Any], voices: Sequence[str]) -> str:
    """The request's voice as the checkpoint spells it (names match case-insensitively)."""
    wanted = str(params.get("voice") or DEFAULT_VOICE)
    for name in voices:
        if name.lower() == wanted.lower():
            return name
    raise StageInputError(f"voice {wanted!r} is not available; voices: {', '.join(voices)}")


class ThinkerStage(StreamingStage):
    """The thinker of Qwen2.5-Omni; subclasses change what it hands the talker."""

    def load(self) -> None:
        from transformers import AutoProcessor

        self.model = self.load_model()
        self.thinker = self.model.thinker
        self.config = self.model.config
        self.embed = self.thinker.get_input_embeddings()
        # Built-in defaults < the stage's spec.sampling; requests override per session.
        self.sampling = Sampling.from_params(THINKER_SAMPLING, self.spec.sampling)
        self.processor = AutoProcessor.from_pretrained(self.model_path)
        self.tokenizer = self.processor.tokenizer
        eos = self.thinker.generation_config.eos_token_id
        if eos is None:
            eos = self.config.thinker_config.text_config.eos_token_id
        self.eos = frozenset([eos] if isinstance(eos, int) else eos)
        self.media_limits = self.settle_media_limits()

    def text_tokenizer(self) -> Any:
        return self.tokenizer

    def settle_media_limits(self) -> EffectiveMedia:
        """The request budget: the spec's limits, else what the processor and context take."""
        return effective_media(
            self.spec.media, processor_media(self.processor, self.context_length), MEDIA_KINDS
        )

    def load_model(self) -> Any:
        return load_qwen25_omni(self.model_path, self.device, "thinker")

    @property
    def context_length(self) -> int:
        """Longest prompt plus reply: engineArgs' max_model_len, else the model's own."""
        limit = self.spec.engine_args.get("max_model_len")
        native = int(self.config.thinker_config.text_config.max_position_embeddings)
        return min(int(limit), native) if limit else native

    @property
    def speaker_map(self) -> dict[str, Any]:
        speakers: dict[str, Any] = self.model.speaker_map
        return speakers

    @property
    def voices(self) -> list[str]:
        return list(self.speaker_map)

    def talker_prompt(self, inputs: Tensors, hidden: HiddenStates, voice: str) -> Tensors:
        """What the talker's prefill needs from the thinker, which owns the embeddings."""
        config = self.config
        input_ids = inputs["input_ids"]
        embeds = hidden[0].clone()
        media_tokens = (
            config.thinker_config.audio_token_index,
            config.thinker_config.image_token_index,
            config.thinker_config.video_token_index,
        )
        media = torch.isin(input_ids, torch.tensor(media_tokens, device=input_ids.device))
        embeds[media] = 0  # as transformers does: the talker sees no media embeddings
        text_bos = int(self.speaker_map[voice]["bos_token"])
        specials = torch.tensor(
            [
                [
                    text_bos,
                    config.talker_config.tts_text_end_token_id,
                    config.talker_config.tts_text_pad_token_id,
                ]
            ],
            device=input_ids.device,
        )
        special_embeds = self.embed(specials)[0]
        prompt: Tensors = {
            "prompt_embeds": (hidden[-1] + embeds)[0],
            "input_ids": input_ids[0],
            "text_bos_id": specials[0, :1],
            "text_bos_embed": special_embeds[0],
            "text_eos_embed": special_embeds[1],
            "text_pad_embed": special_embeds[2],
        }
        return {**prompt, **media_layout(inputs)}

    def reply_row(self, hidden: HiddenStates) -> torch.Tensor:
        """What the talker needs of one fed reply token."""
        return hidden[-1][0, -1:] + hidden[0][0, -1:]

    def prepare(self, job: StageJob) -> None:
        job.prepared = self.conversation(
            job.params.get("messages"), job.params.get("mm_processor_kwargs")
        )

    def prepared_conversation(self, job: StageJob) -> tuple[list[dict[str, Any]], ChatMedia]:
        """What prepare() made, or (a caller that skipped it) the same made now."""
        if job.prepared is None:
            self.prepare(job)
        conversation, media = job.prepared
        return conversation, media

    def open(self, job: StageJob) -> Session:
        return ThinkerSession(self, job)

    def prompt_text(self, conversation: list[dict[str, Any]]) -> str:
        text: str = self.processor.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return text

    def process(self, text: str, media: ChatMedia) -> Any:
        """The processor's model inputs; media it cannot take is the client's error."""
        try:
            with processor_warnings_silenced():
                inputs = self.processor(
                    text=[text],
                    images=media.images or None,
                    audio=media.audios or None,
                    videos=media.videos or None,
                    return_tensors="pt",
                    padding=True,
                    **media.processor_kwargs(),
                )
        except (ValueError, TypeError, IndexError, StopIteration) as exc:
            raise StageInputError(
                f"the processor rejected the input: {refusal_message(exc)}", param="messages"
            ) from None
        if media.videos:
            inputs["use_audio_in_video"] = torch.tensor(media.use_audio_in_video)
        return inputs

    def conversation(
        self, messages: Any, mm_processor_kwargs: Any = None
    ) -> tuple[list[dict[str, Any]], ChatMedia]:
        """Router messages -> the processor's conversation and its media."""
        if not isinstance(messages, list) or not messages:
            raise StageInputError("messages must be a non-empty list")
        rate = self.processor.feature_extractor.sampling_rate
        conversation: list[dict[str, Any]] = []
        media = ChatMedia.from_options(processor_options(mm_processor_kwargs))
        budget = self.media_limits.budget()
        charge_media(messages, budget)
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            role = message.get("role") if isinstance(message, dict) else None
            if not isinstance(role, str) or not isinstance(content, (str, list)):
                raise StageInputError(f"messages[{i}]: needs a role and a content")
            if isinstance(content, str):
                conversation.append({"role": role, "content": content})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind == "image":
                    media.images.append(decode_image(part.get("data"), where))
                    parts.append({"type": "image"})
                elif kind == "audio":
                    media.audios.append(decode_wav(part.get("data"), where, rate))
                    parts.append({"type": "audio"})
                elif kind == "video":
                    track = rate if media.use_audio_in_video else None
                    video = decode_video(part.get("data"), where, media.limits, track, budget)
                    media.add_video(video, where)
                    parts.append({"type": "video"})
                else:
                    raise StageInputError(f"{where}: unsupported content type {kind!r}")
            conversation.append({"role": role, "content": parts})
        return conversation, media


class ThinkerSession(Session):
    def __init__(self, stage: ThinkerStage, job: StageJob) -> None:
        params = job.params
        self.stage = stage
        self.want_audio = bool(params.get("audio"))
        if self.want_audio:
            self.voice = pick_voice(params, stage.voices)
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        self.generator = self.sampling.generator(stage.device)
        conversation, media = stage.prepared_conversation(job)
        inputs = stage.process(stage.prompt_text(conversation), media)
        length = int(inputs["input_ids"].shape[1])
        if length >= stage.context_length:
            # Refused before it takes the engine: a prompt past the context would run
            # for minutes and then fail.
            raise StageInputError(
                f"the prompt is {length} tokens; this model's context is "
                f"{stage.context_length} tokens, and the reply needs at least one"
            )
        self.inputs = {k: v.to(stage.device) for k, v in inputs.items()}
        forced = params.get("forced_reply")
        self.forced: list[int] | None = None
        if forced is not None:
            if not isinstance(forced, str) or not forced:
                raise StageInputError("input must be a non-empty string")
            self.forced = stage.tokenizer(forced, add_special_tokens=False).input_ids
        self.cache: Any = None
        self.rope_deltas: torch.Tensor | None = None
        self.generated: list[int] = []
        self.fed = 0
        self.reply = ReplyText(stage.tokenizer, stage.eos)
        self.prompt: Tensors = {}

    @property
    def prompt_length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    def _choose(self, logits: torch.Tensor) -> int:
        if self.forced is not None:
            step = len(self.generated)
            return self.forced[step] if step < len(self.forced) else min(self.stage.eos)
        seen = torch.tensor(self.generated, dtype=torch.long, device=logits.device)
        seen = torch.cat([self.inputs["input_ids"][0], seen])
        early = len(self.generated) < self.sampling.min_tokens
        suppress = tuple(self.stage.eos) if early else ()
        return next_token(logits, self.sampling, seen, suppress, self.generator)

    def _delta(self, final: bool) -> list[dict[str, Any]]:
        return self.reply.delta(self.generated, final)

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        with torch.inference_mode():
            return self._decode() if self.generated else self._prefill()

    def _prefill(self) -> StepResult:
        from transformers import DynamicCache

        thinker = self.stage.thinker
        layout = layout_kwargs(media_layout(self.inputs))
        positions, self.rope_deltas = rope_index(thinker)(
            self.inputs["input_ids"],
            layout["image_grid_thw"],
            layout["video_grid_thw"],
            self.inputs["attention_mask"],
            layout["use_audio_in_video"],
            layout["audio_feature_lengths"],
            layout["video_second_per_grid"],
        )
        self.cache = DynamicCache()
        inputs = {k: v for k, v in self.inputs.items() if k != "use_audio_in_video"}
        out = thinker(
            **inputs,
            use_audio_in_video=layout["use_audio_in_video"],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.want_audio,
        )
        if self.want_audio:
            self.prompt = self.stage.talker_prompt(self.inputs, out.hidden_states, self.voice)
        self.generated.append(self._choose(out.logits[0, -1]))
        return StepResult(outputs=self._delta(final=False))

    def _finish(self, tensors: Tensors) -> StepResult:
        last = self.generated[-1]
        stopped = last in self.stage.eos or (
            self.forced is not None and len(self.generated) > len(self.forced)
        )
        outputs = self._delta(final=True)
        outputs.append(
            {
                "finish_reason": "stop" if stopped else "length",
                "prompt_tokens": self.prompt_length,
                "completion_tokens": len(self.generated),
            }
        )
        return StepResult(tensors=tensors, outputs=outputs, done=True)

    def _decode(self) -> StepResult:
        last = self.generated[-1]
        stop = last in self.stage.eos or len(self.generated) >= self.sampling.max_tokens
        # The talker cannot start without the first reply token's hidden state, so that
        # token is fed even when it ends the answer.
        if stop and not (self.want_audio and self.fed == 0):
            return self._finish({})
        thinker = self.stage.thinker
        assert self.rope_deltas is not None
        past = self.cache.get_seq_length()
        position = (past + self.rope_deltas).view(1, 1, 1).expand(3, 1, 1)
        out = thinker(
            input_ids=torch.tensor([[last]], device=self.stage.device),
            position_ids=position,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.want_audio,
        )
        tensors: Tensors = {}
        if self.want_audio:
            tensors["reply"] = self.stage.reply_row(out.hidden_states)
            if self.fed == 0:
                tensors.update(self.prompt, first_token_id=torch.tensor([last]))
        self.fed += 1
        if stop:
            return self._finish(tensors)
        self.generated.append(self._choose(out.logits[0, -1]))
        return StepResult(tensors=tensors, outputs=self._delta(final=False))

    def close(self) -> None:
        self.cache = None
