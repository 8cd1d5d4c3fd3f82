"""Odd WAV input is a 400 at the router or a clean input error at the thinker, never a
crash: odd byte counts, 24-bit samples, 3 channels, and a clip cut at every length."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import wave

import numpy as np
import pytest

from omnipipe.router.api.inputs import check_wav
from omnipipe.router.errors import BadRequest
from omnipipe.stagekit.media import decode_wav
from omnipipe.stagekit.stage import StageInputError


def wav_bytes(frames: bytes, width: int, channels: int, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames)
    return buffer.getvalue()


def tone(width: int, channels: int, frames: int = 800) -> bytes:
    signal = (np.sin(np.linspace(0, 40, frames)) * 0.5 * 2 ** (8 * width - 1)).astype("<i4")
    samples = np.repeat(signal, channels)
    if width == 1:
        return bytes((samples // 2**0 + 128).astype(np.uint8))
    return bytes(samples.view(np.uint8).reshape(-1, 4)[:, :width].tobytes())


@pytest.mark.parametrize(("width", "channels"), [(1, 1), (2, 1), (3, 1), (3, 3), (2, 3), (4, 2)])
def test_whole_clips_decode(width: int, channels: int) -> None:
    raw = wav_bytes(tone(width, channels), width, channels)
    check_wav(raw, "clip")
    decoded = decode_wav(base64.b64encode(raw).decode(), "clip", 16000)
    assert len(decoded) == 800
    assert 0.3 < float(np.abs(decoded).max()) < 0.6


@pytest.mark.parametrize(("width", "channels"), [(2, 1), (3, 1), (3, 3), (2, 3), (4, 2)])
def test_a_clip_cut_anywhere_is_decoded_or_refused_cleanly(width: int, channels: int) -> None:
    raw = wav_bytes(tone(width, channels, frames=40), width, channels)
    decoded_cuts = 0
    for length in range(len(raw) + 1):
        cut = raw[:length]
        with contextlib.suppress(BadRequest):  # the router may refuse what it cannot read
            check_wav(cut, "clip")
        try:
            samples = decode_wav(base64.b64encode(cut).decode() or "=", "clip", 16000)
        except StageInputError:
            continue
        # What decodes keeps the whole frames that arrived.
        assert 0 < len(samples) <= 40
        decoded_cuts += 1
    # Cuts inside the data (an odd byte count, a partial frame) still decode.
    assert decoded_cuts > 40


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"width": 2, "channels": 1, "rate": 0}, "no channels or no rate"),
        ({"width": 2, "channels": 1, "rate": 1, "frames": 301}, "longer than 300s"),
    ],
)
def test_impossible_headers_are_refused_by_both(header: dict[str, int], message: str) -> None:
    frames = header.get("frames", 4)
    raw = bytearray(wav_bytes(b"\0\0" * frames, 2, 1, rate=max(header["rate"], 1)))
    struct.pack_into("<I", raw, 24, header["rate"])  # the fmt chunk's sample rate
    with pytest.raises(BadRequest, match=message):
        check_wav(bytes(raw), "clip")
    with pytest.raises(StageInputError, match=message):
        decode_wav(base64.b64encode(bytes(raw)).decode(), "clip", 16000)


def test_unsupported_sample_width_is_named() -> None:
    raw = bytearray(wav_bytes(b"\0" * 40, 2, 1))
    struct.pack_into("<HH", raw, 32, 5, 40)  # block align 5, 40-bit samples
    with pytest.raises(BadRequest):
        check_wav(bytes(raw), "clip")
    with pytest.raises(StageInputError):
        decode_wav(base64.b64encode(bytes(raw)).decode(), "clip", 16000)
