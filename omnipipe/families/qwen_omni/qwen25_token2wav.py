"""The one place omnipipe re-implements part of transformers' Qwen2.5-Omni token2wav:
Qwen2_5OmniToken2WavDiTModel.sample, with the starting noise given rather than drawn.

sample() draws one noise tensor for its whole batch, so a batch of requests could not
each start from its own seed's noise, and a request's audio would depend on its
batch-mates. This copy takes the noise; everything else is sample() as it was read from
PINNED_TRANSFORMERS (its defaults too: guidance 0.5, sway -1, classifier-free guidance
always on). tests/unit/test_qwen25_token2wav.py checks one request, and a batch, against
transformers' own Qwen2_5OmniToken2WavModel (sample() and the vocoder) for each request
alone with the same noise, and PINNED_TRANSFORMERS against the version installed.
"""

from __future__ import annotations

from typing import Any

import torch

PINNED_TRANSFORMERS = "5.19.0"
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0


def sample_mel(
    dit: Any,
    conditioning: torch.Tensor,
    reference_mel: torch.Tensor,
    codes: torch.Tensor,
    noise: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Mel spectrograms (batch x mel bins x frames) for a batch of code rows, each row's
    ODE starting from its own row of `noise` (batch x frames x mel bins)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    frames = codes.shape[1] * dit.repeats
    if frames > dit.config.max_position_embeddings:
        raise ValueError(
            f"mel length {frames} exceeds the DiT's {dit.config.max_position_embeddings}"
        )
    speaker = conditioning.unsqueeze(1).repeat(1, frames, 1)

    def velocity(time_step: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        out = dit(
            hidden_states=hidden_states,
            quantized_code=codes,
            speaker_embedding=speaker,
            condition_vector=reference_mel,
            time_step=time_step,
            apply_cfg=True,
        )
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * GUIDANCE_SCALE

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=speaker.dtype)
    times += SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
    trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)
    mel: torch.Tensor = trajectory[-1].permute(0, 2, 1)
    return mel


def starting_noise(dit: Any, codes: int, seed: int | None, device: torch.device) -> torch.Tensor:
    """The DiT's starting noise for a chunk of `codes` codes, as transformers draws it
    (torch.randn of 1 x mel frames x mel bins, float32) after the manual seed it is given:
    from `seed` when there is one."""
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    shape = (1, codes * dit.repeats, dit.mel_dim)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=device)


def synthesize(
    token2wav: Any,
    conditioning: torch.Tensor,
    reference_mel: torch.Tensor,
    codes: torch.Tensor,
    noise: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Waveforms (batch x samples) for a batch of code rows: one DiT sampling, each row
    from its own noise, then one vocoder pass."""
    mel = sample_mel(
        token2wav.code2wav_dit_model, conditioning, reference_mel, codes, noise, num_steps
    )
    waveforms: torch.Tensor = token2wav.code2wav_bigvgan_model(mel).reshape(len(codes), -1)
    return waveforms
