"""Token sampling and media decoding of the omni stages."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
import torch

from omnipipe.stagekit.media import decode_image, decode_wav, pcm16
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import StageInputError

LOGITS = torch.tensor([0.1, 2.0, 1.9, -3.0, 0.5])
NONE = torch.tensor([], dtype=torch.long)


def test_greedy_and_top_k_one_take_the_argmax() -> None:
    assert next_token(LOGITS, Sampling(temperature=0), NONE) == 1
    assert next_token(LOGITS, Sampling(temperature=1.5, top_k=1), NONE) == 1


def test_repetition_penalty_and_suppression_move_the_choice() -> None:
    penalised = Sampling(temperature=0, repetition_penalty=1.2)
    assert next_token(LOGITS, penalised, torch.tensor([1])) == 2  # 2.0/1.2 < 1.9
    assert next_token(LOGITS, Sampling(temperature=0), NONE, suppress=(1, 2)) == 4


def test_top_p_keeps_only_the_nucleus() -> None:
    sampling = Sampling(temperature=1.0, top_p=0.5)
    picks = {next_token(LOGITS, sampling, NONE) for _ in range(200)}
    assert picks <= {1, 2}  # tokens 1 and 2 hold ~0.74 of the mass; 1 alone ~0.39


def test_sampling_draws_what_transformers_warpers_draw() -> None:
    """Temperature, top-k and top-p as transformers' warpers apply them (the order and the
    arithmetic), so a seed draws the reference's token: logits with ties, nuclei of every
    size, the same generator on both sides."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    for i in range(300):
        logits = torch.round(torch.randn(64, generator=g) * 6) / 2  # ties at the edges
        top_p = (0.3, 0.8, 0.9, 0.95, 0.99)[i % 5]
        sampling = Sampling(temperature=0.9, top_k=50, top_p=top_p)
        ours = next_token(logits, sampling, NONE, generator=torch.Generator().manual_seed(i))
        scores = logits[None].clone()
        for warper in (TemperatureLogitsWarper(0.9), TopKLogitsWarper(50), TopPLogitsWarper(top_p)):
            scores = warper(torch.empty((1, 0), dtype=torch.long), scores)
        drawn = torch.multinomial(
            scores.softmax(-1)[0], 1, generator=torch.Generator().manual_seed(i)
        )
        assert ours == int(drawn), (i, top_p)


def test_seeded_sampling_repeats() -> None:
    sampling = Sampling(temperature=1.0, seed=3)

    def draws() -> list[int]:
        g = sampling.generator(torch.device("cpu"))
        return [next_token(LOGITS, sampling, NONE, generator=g) for _ in range(20)]

    assert draws() == draws()


def test_request_values_override_defaults_and_are_checked() -> None:
    defaults = Sampling(temperature=0.9, max_tokens=100)
    merged = Sampling.from_params(defaults, {"max_tokens": 5, "top_k": None})
    assert (merged.temperature, merged.max_tokens, merged.top_k) == (0.9, 5, 0)
    for bad, match in (
        ({"bogus": 1}, "unknown sampling parameters: bogus"),
        ({"top_p": 0}, "top_p"),
        ({"min_tokens": 200}, "min_tokens"),
        ({"max_tokens": "many"}, "invalid sampling parameter"),
        ([1], "must be an object"),
    ):
        with pytest.raises(StageInputError, match=match):
            Sampling.from_params(defaults, bad)


def wav(samples: np.ndarray, width: int, rate: int, channels: int = 1) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("width", "dtype", "scale"),
    [(1, np.uint8, None), (2, "<i2", 2**15), (4, "<i4", 2**31)],
)
def test_wav_widths_decode_to_the_same_signal(width: int, dtype: str, scale: int | None) -> None:
    signal = np.sin(np.linspace(0, 20, 1600)) * 0.5
    if scale is None:
        raw = np.round(signal * 128 + 128).astype(np.uint8)
    else:
        raw = np.round(signal * scale).astype(dtype)
    decoded = decode_wav(wav(raw, width, 16000), "clip", 16000)
    assert decoded.dtype == np.float32
    step = 1 / 128 if width == 1 else 1e-4  # 8-bit audio is only this fine
    np.testing.assert_allclose(decoded, signal, atol=step)


def test_24_bit_stereo_is_mixed_down_and_resampled() -> None:
    left = (np.sin(np.linspace(0, 30, 4800)) * 0.25 * 2**23).astype("<i4")
    frames = np.stack([left, left], axis=1).reshape(-1)
    packed = frames.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].copy()
    decoded = decode_wav(wav(packed, 3, 48000, channels=2), "clip", 16000)
    assert len(decoded) == 1600  # 0.1 s at 16 kHz
    assert 0.2 < float(np.abs(decoded).max()) < 0.3


@pytest.mark.parametrize("data", ["%%%", base64.b64encode(b"RIFF....garbage").decode(), ""])
def test_bad_audio_and_images_are_input_errors(data: str) -> None:
    with pytest.raises(StageInputError, match="clip"):
        decode_wav(data, "clip", 16000)
    with pytest.raises(StageInputError, match="picture"):
        decode_image(data, "picture")


def test_pcm16_clips() -> None:
    assert np.frombuffer(pcm16(np.array([2.0, -2.0, 0.0])), "<i2").tolist() == [32767, -32767, 0]
