"""Small synthetic clips made with PyAV for the video tests: moving coloured frames and,
optionally, a sine tone as the audio track."""

from __future__ import annotations

import base64
import io

import av
import numpy as np

CODECS = {"mp4": ("libx264", "aac", 16000), "webm": ("libvpx", "libopus", 48000)}


def make_video(
    seconds: float = 2.0,
    width: int = 64,
    height: int = 48,
    fps: int = 10,
    container: str = "mp4",
    audio: bool = True,
) -> bytes:
    video_codec, audio_codec, rate = CODECS[container]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        video = out.add_stream(video_codec, rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = out.add_stream(audio_codec, rate=rate) if audio else None
        for i in range(int(seconds * fps)):
            image = np.zeros((height, width, 3), np.uint8)
            image[..., 0] = (i * 20) % 255
            image[:, : (i * 3) % width, 1] = 200
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if sound is not None:
            t = np.arange(int(seconds * rate)) / rate
            samples = (np.sin(2 * np.pi * 440 * t) * 0.3).astype(np.float32)
            size = sound.codec_context.frame_size or 1024
            for start in range(0, len(samples), size):
                frame = av.AudioFrame.from_ndarray(
                    samples[None, start : start + size], format="flt", layout="mono"
                )
                frame.sample_rate, frame.pts = rate, start
                for packet in sound.encode(frame):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)
    return buffer.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_url(raw: bytes, container: str = "mp4") -> str:
    return f"data:video/{container};base64,{b64(raw)}"
