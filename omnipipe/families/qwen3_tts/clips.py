"""A Base request's reference clip as the speaker encoder takes it: mono float32 at 24 kHz,
from a WAV sent as base64 or a data: URL. Refused from its header past a minute or outside
8 to 192 kHz, before it is decoded; refused under a second once decoded (the encoder's
reflect padding needs more samples than a short clip has, and a voice needs more anyway).
Another rate is resampled with FFmpeg's filtered resampler (PyAV), where qwen-tts uses
soxr (librosa): the same voice, not the same samples."""

from __future__ import annotations

import base64
import io
import wave

import av
import numpy as np

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.families.qwen3_tts.speaker_encoder import SAMPLE_RATE
from omnipipe.stagekit.media import MediaBudget, charge_wav, decode_wav
from omnipipe.stagekit.stage import StageInputError

# qwen-tts's examples use 3 to 20 s; a minute is plenty for a voice.
LIMITS = MediaLimits(max_audio_clips=1, max_audio_clip_seconds=60.0)
MIN_SECONDS = 1.0


def reference_clip(clip: str) -> np.ndarray:
    if clip.startswith("data:"):
        clip = clip.partition(",")[2]
    charge_wav(clip, "ref_audio", MediaBudget(LIMITS))  # the header: seconds, rate, bytes
    with wave.open(io.BytesIO(base64.b64decode(clip))) as header:
        rate = header.getframerate()
    samples = decode_wav(clip, "ref_audio", rate)
    if len(samples) < MIN_SECONDS * rate:
        raise StageInputError(
            f"ref_audio: the clip is {len(samples) / rate:.2f} s; a voice's clip is at least "
            f"{MIN_SECONDS:g} s",
            "ref_audio",
        )
    return samples if rate == SAMPLE_RATE else resampled(samples, rate)


def resampled(samples: np.ndarray, rate: int) -> np.ndarray:
    """Mono float32 at `rate` -> at 24 kHz, low-pass filtered (libswresample)."""
    frame = av.AudioFrame.from_ndarray(samples[np.newaxis, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    frames = [*resampler.resample(frame), *resampler.resample(None)]
    out: np.ndarray = np.concatenate([f.to_ndarray()[0] for f in frames]).astype(np.float32)
    return out
