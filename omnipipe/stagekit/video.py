"""Decode a chat request's video with PyAV: frames sampled as Qwen's omni utilities
(qwen-omni-utils' fetch_video) sample them for Qwen2.5-Omni and Qwen3-Omni, and the audio
track when the request asks for it.

Memory stays bounded whatever the file says about itself: the byte size is checked before
the container is opened; the frame size, the duration and the decoding work (frames
times their pixels) are checked on the demuxed packets before any frame is decoded; and
kept frames are scaled down by the decoder as they arrive (one full-resolution frame at
a time, never the whole clip), at most max_frames of them within a total pixel budget.
With a request's media budget, the frames the clip keeps and its sound track's length
(from its demuxed packets) are charged to it before any frame or sample is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.stagekit.media import MediaBudget
from omnipipe.stagekit.stage import StageInputError

# qwen-omni-utils' vision_process.py: 2 frames/s, 4 to 768 frames in pairs (the vision
# tower's temporal patch), at most 768 x 28 x 28 pixels a frame and 128000 x 28 x 28 x 0.9
# over the whole clip.
VIDEO_FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
FRAME_FACTOR = 2
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
# The router holds the same byte and length limits (router/api/inputs.py).
MAX_VIDEO_BYTES = 16 * 1024 * 1024
MAX_VIDEO_SECONDS = 300
# The largest frame the decoder may produce at full size (one at a time): 8K UHD.
MAX_SOURCE_PIXELS = 7680 * 4320
MAX_SAMPLING_FPS = 8.0
# What the demuxer may find before any frame is decoded: every frame is decoded (the kept
# ones are sampled from all), so their count bounds the work, and a clip of thousands of
# frames a second (20,000 in 0.2 s) is no video a camera made.
MAX_SOURCE_FRAMES = 18_000
MAX_SOURCE_FPS = 240.0
# ... and frames times their size is the decoder's work: an 8K clip of 18,000 frames, inside
# each limit above, took 219 s to decode. 2**32 pixels is a minute of 1080p at 30 frames a
# second, or five of 480p: about 10 to 20 s of decoding on one core.
MAX_DECODE_PIXELS = 2**32


@dataclass(frozen=True)
class VideoLimits:
    fps: float = VIDEO_FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS
    max_seconds: float = MAX_VIDEO_SECONDS
    max_bytes: int = MAX_VIDEO_BYTES
    max_source_frames: int = MAX_SOURCE_FRAMES
    max_source_fps: float = MAX_SOURCE_FPS
    max_decode_pixels: int = MAX_DECODE_PIXELS


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # T x H x W x 3, uint8
    fps: float  # frames kept per second of the clip: the processor's `fps`
    seconds: float
    audio: np.ndarray | None  # mono float32 at the requested rate, when asked for


def frame_count(total: int, seconds: float, limits: VideoLimits) -> int:
    """How many frames to keep of `total` over `seconds` (qwen-omni-utils' smart_nframes):
    fps frames a second, min_frames to max_frames, an even count; never more than exist
    (a one-frame clip keeps its frame twice)."""
    low = math.ceil(limits.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(min(limits.max_frames, total) / FRAME_FACTOR) * FRAME_FACTOR
    count = round(min(max(seconds * limits.fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    return max(FRAME_FACTOR, count)


def frame_size(width: int, height: int, count: int, limits: VideoLimits) -> tuple[int, int]:
    """The kept frames' size: the clip's own, scaled down (never up) to the per-frame
    budget, which shrinks as frames are added so the clip stays within total_pixels."""
    budget = max(
        min(limits.max_pixels, limits.total_pixels / count * FRAME_FACTOR),
        int(min(VIDEO_MIN_PIXELS, limits.max_pixels) * 1.05),
    )
    if width * height <= budget:
        return width, height
    scale = math.sqrt(budget / (width * height))
    # Even sizes: the scaler works on 4:2:0 chroma pairs.
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def video_bytes(data: object, where: str, limits: VideoLimits) -> bytes:
    if not isinstance(data, str) or not data:
        raise StageInputError(f"{where}: expected base64 data")
    if len(data) * 3 // 4 > limits.max_bytes + 3:
        raise StageInputError(f"{where}: video larger than {limits.max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise StageInputError(f"{where}: not valid base64") from None
    if len(raw) > limits.max_bytes:
        raise StageInputError(f"{where}: video larger than {limits.max_bytes} bytes")
    return raw


def decode_video(
    data: object,
    where: str,
    limits: VideoLimits,
    audio_rate: int | None = None,
    budget: MediaBudget | None = None,
) -> Video:
    """The sampled frames (and with audio_rate, the audio track as mono float32 at that
    rate) of an mp4 or webm clip sent as base64, charged to `budget` before decoding."""
    import av

    raw = video_bytes(data, where, limits)
    try:
        with av.open(io.BytesIO(raw), mode="r", metadata_errors="ignore") as container:
            return _decode(container, where, limits, audio_rate, budget or _unbounded())
    except av.FFmpegError as exc:
        raise StageInputError(f"{where}: not a decodable video (mp4, webm): {exc}") from None


def _unbounded() -> MediaBudget:
    return MediaBudget(MediaLimits())


def _decode(
    container: Any, where: str, limits: VideoLimits, audio_rate: int | None, budget: MediaBudget
) -> Video:
    if not container.streams.video:
        raise StageInputError(f"{where}: the file has no video stream")
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width < 1 or height < 1:
        raise StageInputError(f"{where}: the video stream has no frame size")
    if width * height > MAX_SOURCE_PIXELS:
        raise StageInputError(
            f"{where}: frames of {width}x{height} are larger than {MAX_SOURCE_PIXELS} pixels"
        )
    sound = None
    if audio_rate is not None:
        if not container.streams.audio:
            raise StageInputError(
                f"{where}: use_audio_in_video is set but the video has no audio track"
            )
        sound = container.streams.audio[0]
    # Demux only (no decoding) for the true frame count and duration: headers can lie.
    base = stream.time_base
    times: list[float] = []
    track = _TrackSpan()
    for packet in container.demux(*[s for s in (stream, sound) if s is not None]):
        if packet.stream is sound:
            track.add(packet)
        elif packet.pts is not None and packet.size:
            times.append(float(packet.pts * base))
            if times[-1] - times[0] > limits.max_seconds:
                raise StageInputError(f"{where}: video longer than {limits.max_seconds:g}s")
            if len(times) > limits.max_source_frames:
                raise StageInputError(
                    f"{where}: video of more than {limits.max_source_frames} frames"
                )
    if not times:
        raise StageInputError(f"{where}: the video stream holds no frames")
    times.sort()
    total = len(times)
    step = (times[-1] - times[0]) / (total - 1) if total > 1 else 1 / limits.fps
    seconds = times[-1] - times[0] + step
    if seconds > limits.max_seconds:
        raise StageInputError(f"{where}: video longer than {limits.max_seconds:g}s")
    if total > limits.max_source_fps * seconds:
        raise StageInputError(
            f"{where}: {total} frames in {seconds:.2f}s, more than "
            f"{limits.max_source_fps:g} frames a second"
        )
    if total * width * height > limits.max_decode_pixels:
        raise StageInputError(
            f"{where}: decoding {total} frames of {width}x{height} is "
            f"{total * width * height} pixels of work, past the limit of "
            f"{limits.max_decode_pixels} (send a shorter clip, or one of smaller frames)"
        )
    count = frame_count(total, seconds, limits)
    budget.take_video(count, seconds, where)
    if sound is not None:
        # The track is a clip of the request's audio; its demuxed length is what it costs.
        rate = int(sound.codec_context.sample_rate or audio_rate or 1)
        budget.take_audio(round(track.seconds * rate), rate, f"{where} (its audio track)")
    keep = set(np.linspace(0, total - 1, count).round().astype(int).tolist())
    out_width, out_height = frame_size(width, height, count, limits)
    container.seek(0)
    frames: list[np.ndarray] = []
    for index, frame in enumerate(container.decode(stream)):
        # Every frame, not the header alone: a stream may change size at a keyframe.
        if frame.width * frame.height > MAX_SOURCE_PIXELS:
            raise StageInputError(
                f"{where}: frame {index} is {frame.width}x{frame.height}, larger than "
                f"{MAX_SOURCE_PIXELS} pixels"
            )
        if index in keep:
            frames.append(frame.to_ndarray(width=out_width, height=out_height, format="rgb24"))
        if index + 1 >= total:
            break
    if len(frames) < min(count, FRAME_FACTOR):
        raise StageInputError(f"{where}: the video's frames could not be decoded")
    # Pairs of frames make one temporal patch: repeat the last if the tail decoded short.
    while len(frames) % FRAME_FACTOR:
        frames.append(frames[-1])
    audio = None
    if sound is not None and audio_rate is not None:
        # The decoded track may run a little past its packets' span (a codec's priming
        # samples), not past what was charged by more than that.
        most = min(limits.max_seconds, track.seconds + TRACK_SLACK_SECONDS)
        audio = _audio_track(container, sound, where, audio_rate, most)
    return Video(np.stack(frames), len(frames) / seconds, seconds, audio)


TRACK_SLACK_SECONDS = 1.0


class _TrackSpan:
    """The seconds a stream's demuxed packets cover: first start to last end."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0

    def add(self, packet: Any) -> None:
        if packet.pts is None or not packet.size:
            return
        start = float(packet.pts * packet.time_base)
        end = start + float((packet.duration or 0) * packet.time_base)
        self.start = start if self.start is None else min(self.start, start)
        self.end = max(self.end, end)

    @property
    def seconds(self) -> float:
        return 0.0 if self.start is None else max(0.0, self.end - self.start)


def _audio_track(
    container: Any, stream: Any, where: str, rate: int, most_seconds: float
) -> np.ndarray:
    import av

    container.seek(0)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts: list[np.ndarray] = []
    kept, most = 0, int(most_seconds * rate)
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            parts.append(out.to_ndarray().reshape(-1))
            kept += parts[-1].shape[0]
        if kept > most:
            raise StageInputError(f"{where}: audio track longer than {most_seconds:g}s")
    for out in resampler.resample(None):
        parts.append(out.to_ndarray().reshape(-1))
    if not parts or sum(p.shape[0] for p in parts) == 0:
        raise StageInputError(f"{where}: the video's audio track holds no samples")
    track: np.ndarray = np.concatenate(parts).astype(np.float32)
    return track
