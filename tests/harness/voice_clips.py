"""Reference clips to clone a voice from, made here: deterministic, with a voice's shape
(a gliding tone, its harmonics, breath) so that speaker encoders tell them apart."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np


def clip(seconds: float, rate: int = 24000, seed: int = 0) -> str:
    """A reference clip to clone, as a data: URL of a 16-bit mono WAV: a gliding tone
    with its harmonics and some breath (noise), seeded."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 110 + 60 * np.sin(2 * np.pi * 0.7 * t) + 20 * seed
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    noise = np.random.default_rng(seed).normal(0, 0.05, len(t))
    samples = np.clip(0.25 * voiced + noise, -1, 1)
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((samples * 32767).astype("<i2").tobytes())
    return "data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode()
