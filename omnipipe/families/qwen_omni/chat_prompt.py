"""A Qwen Omni thinker's prompt, whichever engine runs it: the router's messages become the
processor's conversation and the request's media, decoded within the stage's media
budget; the chat template makes the prompt text, and the processor its model inputs
(which the transformers thinker runs, and from which the vLLM thinker takes the media
layout the talker's rope index reads)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.stagekit.chat_media import (
    ChatMedia,
    processor_media,
    processor_options,
    processor_warnings_silenced,
)
from omnipipe.stagekit.media import charge_media, decode_image, decode_wav
from omnipipe.stagekit.media_limits import EffectiveMedia, effective_media
from omnipipe.stagekit.stage import StageInputError, StageJob, refusal_message
from omnipipe.stagekit.video import decode_video

# The media a Qwen Omni prompt takes.
MEDIA_KINDS = ("image", "audio", "video")
Conversation = list[dict[str, Any]]


class ChatPrompt:
    """The checkpoint's `processor` and the request budget it settles at construction:
    the stage spec's `media` limits, else what the processor and `context_length` take."""

    def __init__(
        self,
        processor: Any,
        media: MediaLimits,
        context_length: int,
        encoder_cache_tokens: int | None = None,
    ) -> None:
        self.processor = processor
        model = processor_media(processor, context_length, encoder_cache_tokens)
        self.media_limits: EffectiveMedia = effective_media(media, model, MEDIA_KINDS)

    @property
    def sampling_rate(self) -> int:
        """The rate the processor's audio features are made at: audio is decoded to it."""
        rate: int = self.processor.feature_extractor.sampling_rate
        return rate

    def prepare(self, job: StageJob) -> None:
        """The stage's prepare(): the request's conversation and media, in job.prepared."""
        job.prepared = self.conversation(
            job.params.get("messages"), job.params.get("mm_processor_kwargs")
        )

    def prepared(self, job: StageJob) -> tuple[Conversation, ChatMedia]:
        """What prepare() made, or (a caller that skipped it) the same made now."""
        if job.prepared is None:
            self.prepare(job)
        conversation, media = job.prepared
        return conversation, media

    def prompt_text(self, conversation: Conversation) -> str:
        text: str = self.processor.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return text

    def model_inputs(self, text: str, media: ChatMedia) -> Any:
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
    ) -> tuple[Conversation, ChatMedia]:
        """Router messages -> the processor's conversation and its media."""
        if not isinstance(messages, list) or not messages:
            raise StageInputError("messages must be a non-empty list")
        rate = self.sampling_rate
        conversation: Conversation = []
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
