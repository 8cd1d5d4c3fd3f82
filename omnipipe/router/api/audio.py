"""Audio containers for responses: the stages send 16-bit little-endian mono PCM."""

from __future__ import annotations

import base64
import io
import wave


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm)
    return buffer.getvalue()


def pcm_of(output: dict[str, object]) -> bytes:
    return base64.b64decode(str(output["audio"]))
