"""A chat stage's media budget as its loaded model allows it. Each limit the stage's spec
leaves unset is the tighter of its default and what the model takes; one the spec sets
wins, with a warning at load where the model cannot use all of it.

What a model takes, where it can be known:
- maxImages: images of the smallest token cost (the processor's least tokens an image)
  that fit the context beside one reply token.
- maxAudioSeconds: seconds of audio that fit the context at the audio encoder's tokens a
  second (measured on the processor).
- maxAudioClipSeconds: where the processor keeps only the start of a longer clip (the
  Whisper feature extractor's chunk_length, when it truncates), that length.
- maxVideoFrames: sampled frames of the smallest token cost (the video processor's least
  tokens a temporal patch, over its frames) that fit the context beside one reply token,
  and, on an engine whose encoder caches one item's tokens at most (vLLM's encoder cache),
  that fit that cache: a clip past it is refused before a frame is decoded, not after.
Not derived, and why: maxImagePixels (the processors resize every image down to their
max_pixels, so pixels cost decoding memory here, not context), maxAudioClips (a clip of
a few milliseconds is one token or none, so the context bounds seconds, not clips), and
the sample rates (every clip is resampled to the feature extractor's own rate; the
limits bound what resampling costs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic.alias_generators import to_camel

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.stagekit.media import MediaBudget

log = logging.getLogger(__name__)

Source = Literal["spec", "processor", "context", "encoder cache", "default"]
IMAGE_LIMITS = ("max_images", "max_image_pixels")
AUDIO_LIMITS = (
    "max_audio_clips",
    "max_audio_seconds",
    "max_audio_clip_seconds",
    "min_sample_rate",
    "max_sample_rate",
)
VIDEO_LIMITS = ("max_video_frames",)


@dataclass(frozen=True)
class ModelMedia:
    """What the loaded model takes, where it is known (None: nothing to derive)."""

    context: int  # tokens of prompt and reply together
    image_tokens: int | None = None  # the fewest tokens an image takes
    audio_tokens_per_second: float | None = None
    clip_seconds: float | None = None  # the processor keeps at most this much of a clip
    # The fewest tokens a temporal patch of a video takes, and its frames.
    video_patch_tokens: int | None = None
    video_patch_frames: int = 2
    # The most tokens the engine's encoder holds for one media item (None: no such bound).
    encoder_cache_tokens: int | None = None

    def bounds(self) -> dict[str, tuple[float, Source, str]]:
        """Limit -> (the most the model takes, its source, why), for the derivable ones."""
        bounds: dict[str, tuple[float, Source, str]] = {}
        room = max(0, self.context - 1)  # a prompt leaves the reply one token
        if self.image_tokens:
            images = room // self.image_tokens
            bounds["max_images"] = (
                images,
                "context",
                f"its {self.context} tokens hold at most {images} images of "
                f"{_tokens(self.image_tokens)} or more",
            )
        if self.audio_tokens_per_second:
            seconds = math.floor(room / self.audio_tokens_per_second)
            bounds["max_audio_seconds"] = (
                float(seconds),
                "context",
                f"its {self.context} tokens hold at most {seconds}s of audio at "
                f"{_number(self.audio_tokens_per_second)} tokens a second",
            )
        if self.clip_seconds:
            bounds["max_audio_clip_seconds"] = (
                self.clip_seconds,
                "processor",
                f"it keeps only the first {_number(self.clip_seconds)}s of a clip",
            )
        if self.video_patch_tokens:
            frames = room // self.video_patch_tokens * self.video_patch_frames
            bounds["max_video_frames"] = (
                frames,
                "context",
                f"its {self.context} tokens hold at most {frames} frames of video at "
                f"{self._per_frame()} tokens a frame or more",
            )
            cache = self.encoder_cache_tokens
            cached = cache // self.video_patch_tokens * self.video_patch_frames if cache else None
            if cached is not None and cached < frames:
                bounds["max_video_frames"] = (
                    cached,
                    "encoder cache",
                    f"its encoder holds {cache} tokens of one item, at most {cached} frames "
                    f"of video at {self._per_frame()} tokens a frame or more",
                )
        return bounds

    def _per_frame(self) -> str:
        return _number((self.video_patch_tokens or 0) / self.video_patch_frames)

    def describe(self) -> str:
        parts = [f"context {self.context} tokens"]
        if self.image_tokens:
            parts.append(f"an image {_tokens(self.image_tokens)} or more")
        if self.audio_tokens_per_second:
            parts.append(f"audio {_number(self.audio_tokens_per_second)} tokens a second")
        if self.clip_seconds:
            parts.append(f"clips cut at {_number(self.clip_seconds)}s")
        if self.video_patch_tokens:
            parts.append(f"video {self._per_frame()} tokens a frame or more")
        if self.encoder_cache_tokens:
            parts.append(f"encoder cache {self.encoder_cache_tokens} tokens an item")
        return ", ".join(parts)


@dataclass(frozen=True)
class EffectiveMedia:
    """The limits a stage charges requests against, and where each comes from."""

    limits: MediaLimits = field(default_factory=MediaLimits)
    sources: Mapping[str, Source] = field(default_factory=dict)
    # Limit -> what a refusal by it adds: the limit's name, its source and why.
    notes: Mapping[str, str] = field(default_factory=dict)
    kinds: tuple[str, ...] = ("image", "audio")

    def budget(self) -> MediaBudget:
        return MediaBudget(self.limits, self.notes)

    def summary(self) -> str:
        """One line: each limit the stage charges, its value and its source."""
        names = (
            (IMAGE_LIMITS if "image" in self.kinds else ())
            + (AUDIO_LIMITS if "audio" in self.kinds else ())
            + (VIDEO_LIMITS if "video" in self.kinds else ())
        )
        values = self.limits.model_dump()
        return ", ".join(
            f"{to_camel(n)} {_number(values[n])} ({self.sources.get(n, 'default')})" for n in names
        )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


# What becomes of a request past a limit the spec sets higher than the model takes.
PAST_THE_MODEL: Mapping[Source, str] = {
    "context": "a request past it cannot fit and is refused for its length, once decoded",
    "encoder cache": "a clip past it is refused by the engine, once decoded",
    "processor": "the processor drops what is past it",
}


def effective_media(
    spec: MediaLimits, model: ModelMedia, kinds: tuple[str, ...] = ("image", "audio")
) -> EffectiveMedia:
    """The spec's limits where it sets them, else the tighter of default and model. Logs
    the result once, and warns of a set limit the model cannot use all of."""
    given = spec.model_fields_set
    values: dict[str, float] = {}
    sources: dict[str, Source] = {
        n: ("spec" if n in given else "default") for n in MediaLimits.model_fields
    }
    notes: dict[str, str] = {}
    for name, (bound, source, why) in model.bounds().items():
        camel = to_camel(name)
        value = getattr(spec, name)
        if name in given:
            if value > bound:
                log.warning(
                    "media.%s %s is more than the model takes (its %s: %s); the spec's "
                    "value stands: %s",
                    camel,
                    _number(value),
                    source,
                    why,
                    PAST_THE_MODEL.get(source, ""),
                )
            continue
        if bound < value:
            values[name] = bound
            sources[name] = source
            notes[name] = f"{camel}, from the model's {source}: {why}"
    effective = EffectiveMedia(spec.model_copy(update=values), sources, notes, kinds)
    log.info("media limits: %s; the model: %s", effective.summary(), model.describe())
    return effective
