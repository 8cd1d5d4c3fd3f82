"""Qwen2.5-Omni's token2wav as omnipipe runs it (qwen25_token2wav.synthesize, shared by the
transformers and the vLLM code2wav stages) against transformers' own
Qwen2_5OmniToken2WavModel.forward, DiT sampling and vocoder, for the same starting noise:
the one place omnipipe re-implements transformers code is checked against the original,
and fails the day transformers' sample() changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.checkpoint import load_qwen25_omni
from omnipipe.families.qwen_omni.qwen25_token2wav import (
    PINNED_TRANSFORMERS,
    starting_noise,
    synthesize,
)

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
STEPS = 4


@pytest.fixture(scope="module")
def model() -> Any:
    return load_qwen25_omni(resolve_model_path("tiny://qwen2.5-omni"), CPU, "token2wav")


def voice(model: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    speaker = list(model.speaker_map.values())[index % len(model.speaker_map)]
    return speaker["cond"].float(), speaker["ref_mel"].float()


def codes_of(model: Any, count: int, seed: int) -> torch.Tensor:
    vocab = model.token2wav.code2wav_dit_model.config.num_embeds
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))


def reference(model: Any, codes: torch.Tensor, voice_index: int, seed: int) -> torch.Tensor:
    """transformers' own token2wav, its noise drawn from the global generator as it does."""
    conditioning, reference_mel = voice(model, voice_index)
    torch.manual_seed(seed)
    with torch.inference_mode():
        wave: torch.Tensor = model.token2wav(
            codes[None], conditioning=conditioning, reference_mel=reference_mel, num_steps=STEPS
        )
    return wave.reshape(-1)


def test_the_pinned_transformers_is_the_one_installed() -> None:
    assert transformers.__version__ == PINNED_TRANSFORMERS, (
        f"qwen25_token2wav.py was read from transformers {PINNED_TRANSFORMERS}; "
        f"{transformers.__version__} is installed: compare sample() and update the pin"
    )


def test_one_request_equals_transformers_token2wav_for_the_same_noise(model: Any) -> None:
    codes = codes_of(model, 40, seed=1)
    dit = model.token2wav.code2wav_dit_model
    conditioning, reference_mel = voice(model, 0)
    with torch.inference_mode():
        ours = synthesize(
            model.token2wav,
            conditioning,
            reference_mel,
            codes[None],
            starting_noise(dit, len(codes), 7, CPU),
            STEPS,
        ).reshape(-1)
    theirs = reference(model, codes, 0, seed=7)
    assert ours.shape == theirs.shape
    assert theirs.abs().max() > 0  # a vocoder that said nothing would match too
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_a_batch_is_each_request_alone_through_transformers(model: Any) -> None:
    """Three requests, each with its own codes, voice and seed, in one sampling."""
    rows = [(codes_of(model, 40, seed=i), i, 100 + i) for i in range(3)]
    dit = model.token2wav.code2wav_dit_model
    voices = [voice(model, v) for _, v, _ in rows]
    with torch.inference_mode():
        batched = synthesize(
            model.token2wav,
            torch.cat([c for c, _ in voices]),
            torch.cat([r for _, r in voices]),
            torch.stack([codes for codes, _, _ in rows]),
            torch.cat([starting_noise(dit, 40, seed, CPU) for _, _, seed in rows]),
            STEPS,
        )
    for (codes, voice_index, seed), ours in zip(rows, batched, strict=True):
        theirs = reference(model, codes, voice_index, seed)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
