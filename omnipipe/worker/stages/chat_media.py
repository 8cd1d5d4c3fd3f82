"""A chat request's media as the thinker's processor takes it: images, audio clips, video
frames, and the processor keyword arguments the request may set (mm_processor_kwargs)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnipipe.worker.stages.base import StageInputError
from omnipipe.worker.stages.video import MAX_SAMPLING_FPS, VIDEO_FPS, Video, VideoLimits

# The mm_processor_kwargs a request may set (the router checks the same): the others
# change how the checkpoint's processor sizes things, which the limits here bound.
PROCESSOR_KWARGS = ("use_audio_in_video", "fps")
MAX_VIDEOS = 1  # the processors take one fps per call; it is the video's own


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
