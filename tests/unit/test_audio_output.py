"""Speech in the format and at the speed the client asks for (stagekit/audio_output.py):
each container decodes with PyAV to the length it was given, the first bytes leave with
the first audio, and speed changes the length but not the pitch (measured on a tone)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from omnipipe.stagekit.audio_output import SpeechEncoder, speech_encoder, tempo_factors

RATE = 24_000
TONE_HZ = 440.0


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (np.sin(2 * np.pi * TONE_HZ * t) * 12_000).astype("<i2")


def encode(fmt: str, speed: float, pcm: np.ndarray, piece: int = 4800) -> tuple[bytes, list[int]]:
    """The whole encoding, and the bytes each push gave back."""
    encoder = SpeechEncoder(fmt, RATE, speed)
    pushed = [encoder.push(pcm[i : i + piece].tobytes()) for i in range(0, len(pcm), piece)]
    return b"".join(pushed) + encoder.finish(), [len(p) for p in pushed]


def decoded(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """(mono samples as floats, their rate), as a client's decoder reads them."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(float), RATE
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(container.streams.audio[0]))
    samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(float)
    return samples, frames[0].sample_rate


def pitch(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


@pytest.mark.parametrize("fmt", ["mp3", "aac", "opus", "flac", "pcm"])
@pytest.mark.parametrize("speed", [1.0, 2.0, 0.5, 0.25, 4.0])
def test_each_format_decodes_to_its_length_over_speed_at_the_same_pitch(
    fmt: str, speed: float
) -> None:
    data, pushed = encode(fmt, speed, tone(2.0))
    samples, rate = decoded(data, fmt)
    seconds = len(samples) / rate
    # A codec's frames pad the end by up to one frame (MP3's 1152 samples, 48 ms here).
    assert seconds == pytest.approx(2.0 / speed, abs=0.07), (fmt, speed, seconds)
    assert pitch(samples, rate) == pytest.approx(TONE_HZ, abs=2.0)
    # Streamed: most of the bytes left as the audio was pushed, not at the end (a codec
    # holds a frame, FLAC's 4608 samples; Ogg a 100 ms page).
    assert sum(pushed) >= len(data) / 2, (pushed, len(data))


@pytest.mark.parametrize(
    ("fmt", "container"), [("mp3", "mp3"), ("aac", "aac"), ("opus", "ogg"), ("flac", "flac")]
)
def test_each_format_is_the_container_it_says(fmt: str, container: str) -> None:
    data, _ = encode(fmt, 1.0, tone(0.5))
    with av.open(io.BytesIO(data)) as opened:
        assert container in opened.format.name.split(","), opened.format.name


def test_a_cancelled_answer_frees_its_encoder() -> None:
    encoder = SpeechEncoder("mp3", RATE, 0.5)
    encoder.push(tone(0.3).tobytes())
    encoder.close()
    assert encoder.container is None
    assert encoder.tempo is None
    encoder.close()  # twice: the end and a cancel may both close it


def test_flac_is_lossless() -> None:
    pcm = tone(1.0)
    data, _ = encode("flac", 1.0, pcm)
    samples, _ = decoded(data, "flac")
    assert np.array_equal(samples.astype(np.int16), pcm)


def test_plain_pcm_needs_no_encoder_and_bad_values_are_named() -> None:
    assert speech_encoder({}, RATE) is None  # chat's audio
    assert speech_encoder({"response_format": "wav", "speed": 1.0}, RATE) is None
    assert speech_encoder({"response_format": "pcm", "speed": 2.0}, RATE) is not None
    assert tempo_factors(0.25) == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"speed must be from 0\.25 to 4"):
        tempo_factors(5.0)
    with pytest.raises(ValueError, match="response_format must be one of"):
        SpeechEncoder("ogg", RATE)
