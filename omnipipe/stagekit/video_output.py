"""Video frames as the client gets them from /v1/videos: an H.264 MP4 made in memory with
PyAV, frame by frame as the frames are made, for every family whose last stage makes
video (Wan's decode stage, the diffusers fallback's whole pipeline)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import numpy as np

MP4_CODEC = "libx264"
# x264's constant quality: visually lossless for generated video, a fraction of raw size.
MP4_CRF = "18"


def encode_mp4(
    frames: Iterable[np.ndarray], fps: int, stopped: Callable[[], bool] = lambda: False
) -> tuple[bytes, int]:
    """(height, width, 3) uint8 frames, taken one piece at a time -> an H.264 MP4
    (yuv420p, which every player plays) made in memory, and its frame count. No frame,
    or stopped() once the frames end (a cancelled job): nothing is flushed or written,
    and (b"", count) comes back."""
    buf = io.BytesIO()
    count = 0
    with av_open(buf) as container:
        stream = container.add_stream(MP4_CODEC, rate=Fraction(fps))
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": MP4_CRF}
        for frame in frames:
            if count == 0:
                stream.width, stream.height = int(frame.shape[1]), int(frame.shape[0])
            count += 1
            for packet in stream.encode(av_frame(frame)):
                container.mux(packet)
        if count == 0 or stopped():
            return b"", count
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue(), count


def av_open(buf: io.BytesIO) -> Any:
    import av

    return av.open(buf, mode="w", format="mp4")


def av_frame(rgb: np.ndarray) -> Any:
    import av

    return av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
