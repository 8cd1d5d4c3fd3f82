"""A Base checkpoint's speaker encoder: a reference clip -> the x-vector that takes a
preset speaker's place in the talker's prompt. ECAPA-TDNN over a 128-bin log-mel at
24 kHz, as qwen-tts's Qwen3TTSSpeakerEncoder and mel_spectrogram compute it, operation
for operation (the float rounding is the reference's), with librosa's Slaney mel filters
computed here as librosa does (librosa is not a dependency of the project)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

PREFIX = "speaker_encoder."
SAMPLE_RATE = 24000
# qwen-tts's extract_speaker_embedding()
N_FFT, HOP, WINDOW, MELS, F_MIN, F_MAX = 1024, 256, 1024, 128, 0.0, 12000.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale (librosa's default): linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    mels = hz / f_sp
    log = hz >= min_log_hz
    mels[log] = min_log_hz / f_sp + np.log(hz[log] / min_log_hz) / (np.log(6.4) / 27.0)
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel = min_log_hz / f_sp
    hz = f_sp * mels
    log = mels >= min_log_mel
    hz[log] = min_log_hz * np.exp(np.log(6.4) / 27.0 * (mels[log] - min_log_mel))
    return hz


def mel_filters(rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float) -> np.ndarray:
    """librosa.filters.mel(sr=rate, n_fft=n_fft, n_mels=n_mels, fmin=f_min, fmax=f_max):
    triangles on the Slaney scale, area-normalised, float32 as librosa returns them."""
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    bins = np.fft.rfftfreq(n=n_fft, d=1.0 / rate)
    low, high = _hz_to_mel(np.array([f_min, f_max]))
    edges = _mel_to_hz(np.linspace(low, high, n_mels + 2))
    widths = np.diff(edges)
    ramps = np.subtract.outer(edges, bins)
    for i in range(n_mels):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / widths[i], ramps[i + 2] / widths[i + 1]))
    weights *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[:, np.newaxis]
    return weights


def log_mel(waveform: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """(1, samples) at 24 kHz -> (1, frames, mels): qwen-tts's mel_spectrogram. The reflect
    padding needs more than (N_FFT - HOP) / 2 samples (clips.py asks for a second)."""
    padding = (N_FFT - HOP) // 2
    padded = functional.pad(waveform.unsqueeze(1), (padding, padding), mode="reflect").squeeze(1)
    spec = torch.stft(
        padded,
        N_FFT,
        hop_length=HOP,
        win_length=WINDOW,
        window=torch.hann_window(WINDOW, device=waveform.device),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(filters, magnitude), min=1e-5)).transpose(1, 2)


def _conv(channels_in: int, channels_out: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(
        channels_in, channels_out, kernel, dilation=dilation, padding="same", padding_mode="reflect"
    )


class TimeDelay(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(channels_in, channels_out, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(
            TimeDelay(width, width, kernel, dilation) for _ in range(scale - 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 1:
                part = self.blocks[0](part)
            elif i > 1:
                part = self.blocks[i - 1](part + parts[-1])
            parts.append(part)
        return torch.cat(parts, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, squeezed, 1)
        self.conv2 = _conv(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SqueezeExcitationRes2Net(nn.Module):
    def __init__(
        self, channels_in: int, channels: int, scale: int, squeezed: int, kernel: int, dilation: int
    ) -> None:
        super().__init__()
        self.tdnn1 = TimeDelay(channels_in, channels, 1, 1)
        self.res2net_block = Res2Net(channels, scale, kernel, dilation)
        self.tdnn2 = TimeDelay(channels, channels, 1, 1)
        self.se_block = SqueezeExcitation(channels, squeezed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))
        return out + x


def _statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(1e-12))
    return mean, std


class AttentivePooling(nn.Module):
    """Attentive statistics pooling over one whole clip (the reference's mask is all
    ones: each frame weighs 1/frames in the first statistics)."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = TimeDelay(channels * 3, attention, 1, 1)
        self.conv = _conv(attention, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        uniform = torch.ones(x.shape[0], 1, frames, dtype=x.dtype, device=x.device)
        mean, std = _statistics(x, uniform / uniform.sum(dim=2, keepdim=True))
        context = torch.cat(
            [x, mean.unsqueeze(2).repeat(1, 1, frames), std.unsqueeze(2).repeat(1, 1, frames)],
            dim=1,
        )
        attention = functional.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _statistics(x, attention)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        channels, kernels = config["enc_channels"], config["enc_kernel_sizes"]
        dilations = config["enc_dilations"]
        blocks: list[nn.Module] = [
            TimeDelay(config["mel_dim"], channels[0], kernels[0], dilations[0])
        ]
        blocks += [
            SqueezeExcitationRes2Net(
                channels[i - 1],
                channels[i],
                config["enc_res2net_scale"],
                config["enc_se_channels"],
                kernels[i],
                dilations[i],
            )
            for i in range(1, len(channels) - 1)
        ]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TimeDelay(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentivePooling(channels[-1], config["enc_attention_channels"])
        self.fc = _conv(channels[-1] * 2, config["enc_dim"], 1)
        filters = mel_filters(SAMPLE_RATE, N_FFT, MELS, F_MIN, F_MAX)
        self.register_buffer("filters", torch.from_numpy(filters), persistent=False)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """(1, frames, mels) -> (1, enc_dim)."""
        x = mels.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        pooled: torch.Tensor = self.fc(self.asp(self.mfa(torch.cat(outputs[1:], dim=1))))
        return pooled.squeeze(-1)

    def x_vector(self, waveform: np.ndarray) -> torch.Tensor:
        """A mono float32 clip at 24 kHz -> its (enc_dim,) speaker embedding."""
        filters = self.filters
        assert isinstance(filters, torch.Tensor)
        with torch.inference_mode():
            # On the CPU, as qwen-tts computes it: a GPU's STFT rounds differently.
            clip = torch.from_numpy(np.ascontiguousarray(waveform)).unsqueeze(0)
            mels = log_mel(clip, filters.cpu()).to(filters.device)
            embedding: torch.Tensor = self(mels)[0]
        return embedding

    def load_checkpoint(self, model_path: str, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The encoder's weights from the checkpoint's `speaker_encoder.*`, all of them."""
        ours = {k.removeprefix(PREFIX): v for k, v in weights if k.startswith(PREFIX)}
        missing, unexpected = self.load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{Path(model_path)}: not a Qwen3-TTS speaker encoder this build reads "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
