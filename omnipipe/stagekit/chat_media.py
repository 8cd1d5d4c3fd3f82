"""A chat request's media as the thinker's processor takes it: images, audio clips, video
frames, and the processor keyword arguments the request may set (mm_processor_kwargs)."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnipipe.stagekit.media_limits import ModelMedia
from omnipipe.stagekit.stage import StageInputError
from omnipipe.stagekit.video import MAX_SAMPLING_FPS, VIDEO_FPS, Video, VideoLimits

# The mm_processor_kwargs a request may set (the router checks the same): the others
# change how the checkpoint's processor sizes things, which the limits here bound.
PROCESSOR_KWARGS = ("use_audio_in_video", "fps")
MAX_VIDEOS = 1  # the processors take one fps per call; it is the video's own
log = logging.getLogger(__name__)


def processor_options(raw: object) -> dict[str, Any]:
    """mm_processor_kwargs checked: use_audio_in_video (bool), fps (0 < fps <= 8)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise StageInputError("mm_processor_kwargs must be an object")
    unknown = sorted(set(raw) - set(PROCESSOR_KWARGS))
    if unknown:
        raise StageInputError(
            f"mm_processor_kwargs: {', '.join(unknown)} not supported; "
            f"supported: {', '.join(PROCESSOR_KWARGS)}"
        )
    options: dict[str, Any] = {}
    if "use_audio_in_video" in raw:
        if not isinstance(raw["use_audio_in_video"], bool):
            raise StageInputError("mm_processor_kwargs.use_audio_in_video must be a boolean")
        options["use_audio_in_video"] = raw["use_audio_in_video"]
    if "fps" in raw:
        fps = raw["fps"]
        if isinstance(fps, bool) or not isinstance(fps, (int, float)):
            raise StageInputError("mm_processor_kwargs.fps must be a number")
        if not 0 < fps <= MAX_SAMPLING_FPS:
            raise StageInputError(f"mm_processor_kwargs.fps must be in (0, {MAX_SAMPLING_FPS:g}]")
        options["fps"] = float(fps)
    return options


@dataclass
class ChatMedia:
    """The media of one conversation, in prompt order; a video's audio track (when
    use_audio_in_video) sits among the audio clips where the video is."""

    images: list[Any] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)
    use_audio_in_video: bool = False
    fps: float = VIDEO_FPS  # frames per second sampled from the video(s)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ChatMedia:
        return cls(
            use_audio_in_video=bool(options.get("use_audio_in_video", False)),
            fps=float(options.get("fps", VIDEO_FPS)),
        )

    @property
    def limits(self) -> VideoLimits:
        return VideoLimits(fps=self.fps)

    def add_video(self, video: Video, where: str) -> None:
        if len(self.videos) >= MAX_VIDEOS:
            raise StageInputError(f"{where}: at most {MAX_VIDEOS} video per request")
        self.videos.append(video.frames)
        self.fps = video.fps
        if video.audio is not None:
            self.audios.append(video.audio)

    def __bool__(self) -> bool:
        return bool(self.images or self.audios or self.videos)

    def processor_kwargs(self) -> dict[str, Any]:
        """What the processor is called with besides the media: the sampled fps (its
        temporal positions), and use_audio_in_video."""
        if not self.videos:
            return {}
        return {"fps": self.fps, "use_audio_in_video": self.use_audio_in_video}


@contextlib.contextmanager
def processor_warnings_silenced() -> Iterator[None]:
    """transformers' use_audio_in_video path (5.19) calls np.arange on a torch scalar,
    which NumPy 2 warns about on every call; both engines run that processor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "__array__ implementation", DeprecationWarning)
        yield


def smallest_image_tokens(image_processor: Any) -> int | None:
    """The fewest tokens the processor makes of an image: Qwen2-VL's smart_resize scales
    every image to at least min_pixels, in squares of patch_size * merge_size pixels, each
    one token. None where the processor says no min_pixels, patch or merge size."""
    size = getattr(image_processor, "size", None)
    least = getattr(image_processor, "min_pixels", None) or (
        size.get("shortest_edge")
        if isinstance(size, dict)
        else getattr(size, "shortest_edge", None)
    )
    patch = getattr(image_processor, "patch_size", None)
    merge = getattr(image_processor, "merge_size", None)
    if not (least and patch and merge):
        return None
    return max(1, math.ceil(int(least) / (int(patch) * int(merge)) ** 2))


def _edge(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def smallest_video_patch(processor: Any) -> tuple[int, int] | None:
    """The fewest tokens the processor makes of one temporal patch of a video, and the
    frames in that patch. Frames are resized as images are, to at least the shortest_edge
    pixels the processor's call gives its video processor, in squares of patch_size *
    merge_size pixels, one token each; a patch is temporal_patch_size frames.

    The call's size comes from the processor class's own defaults (transformers 5.19:
    `valid_processor_kwargs._defaults`, 128 squares a patch on both Qwen Omni families),
    which win over the checkpoint's preprocessor config (Qwen2.5-Omni-7B's min_pixels 3136
    does not reach videos); tests/unit/test_media_limits.py measures a patch against it.
    None where the processor has no video processor or says no size."""
    videos = getattr(processor, "video_processor", None)
    if videos is None:
        return None
    defaults = getattr(getattr(processor, "valid_processor_kwargs", None), "_defaults", None)
    size = (defaults or {}).get("videos_kwargs", {}).get("size") or getattr(videos, "size", None)
    least = _edge(size, "shortest_edge") or getattr(videos, "min_pixels", None)
    patch = getattr(videos, "patch_size", None)
    merge = getattr(videos, "merge_size", None)
    frames = getattr(videos, "temporal_patch_size", None)
    if not (least and patch and merge and frames):
        return None
    return max(1, math.ceil(int(least) / (int(patch) * int(merge)) ** 2)), int(frames)


def audio_tokens(processor: Any, seconds: float) -> int:
    """The audio tokens the processor makes of a clip this long (silence)."""
    extractor = processor.feature_extractor
    clip = np.zeros(round(seconds * extractor.sampling_rate), np.float32)
    inputs = processor(text=[processor.audio_token], audio=[clip], return_tensors="pt")
    token = processor.tokenizer.convert_tokens_to_ids(processor.audio_token)
    return int((inputs["input_ids"] == token).sum())


def processor_media(
    processor: Any, context: int, encoder_cache_tokens: int | None = None
) -> ModelMedia:
    """What the thinker's processor makes of media, measured on it: the fewest tokens of
    an image and of a video's temporal patch; the tokens a second of audio over one of the
    feature extractor's chunks; and whether a clip a second longer than that chunk gets
    more tokens (Qwen2.5-Omni's extractor pads and truncates every clip to its chunk;
    Qwen3-Omni's does not)."""
    images = getattr(processor, "image_processor", None)
    image = smallest_image_tokens(images) if images is not None else None
    patch = smallest_video_patch(processor)
    video = {"video_patch_tokens": patch[0], "video_patch_frames": patch[1]} if patch else {}
    try:
        extractor = processor.feature_extractor
        chunk = extractor.n_samples / extractor.sampling_rate
        in_chunk, past_chunk = audio_tokens(processor, chunk), audio_tokens(processor, chunk + 1)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("audio limits not derived: the processor's audio tokens unknown (%s)", exc)
        return ModelMedia(context, image, encoder_cache_tokens=encoder_cache_tokens, **video)
    return ModelMedia(
        context,
        image,
        audio_tokens_per_second=in_chunk / chunk if in_chunk else None,
        clip_seconds=chunk if past_chunk <= in_chunk else None,
        encoder_cache_tokens=encoder_cache_tokens,
        **video,
    )
