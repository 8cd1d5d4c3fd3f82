"""Qwen3-TTS's code2wav: the 12 Hz speech tokenizer's decoder (codes to 24 kHz audio),
under the released weight names of speech_tokenizer/model.safetensors (decoder.*).

Its back half is Qwen3-Omni's code2wav, which transformers holds: the sliding-window
transformer, the ConvNeXt upsamplers, the residual units and SnakeBeta are its classes.
Its own are the front (a split residual quantizer whose 16 codebooks are summed, a causal
conv, projections into and out of the transformer) and one difference in the decoder
blocks: their transposed convolution trims k - s samples on the right only, where
Omni's trims both ends (docs/design/qwen3-tts-spike/REPORT.md, section 5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FOLDER = "speech_tokenizer"
EPSILON = 1e-5  # a codebook vector is its sum over its usage, the usage kept off zero


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B x T) -> (B x dim x T)."""
        table = self.embedding_sum / self.cluster_usage.clamp(min=EPSILON)[:, None]
        return F.embedding(codes, table).transpose(1, 2)


class _Codebooks(nn.Module):
    """Holds `layers.{i}._codebook` as the released names have them."""

    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(size, dim) for _ in range(count))


class _Layer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class ResidualQuantizer(nn.Module):
    def __init__(self, count: int, size: int, dim: int, out: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(out, dim, 1, bias=False)  # the encoder's; kept to load
        self.output_proj = nn.Conv1d(dim, out, 1, bias=False)
        self.vq = _Codebooks(count, size, dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B x K x T) -> (B x out x T): the K codebooks' vectors summed."""
        quantized = torch.zeros([1], device=codes.device)[0]
        for layer, layer_codes in zip(self.vq.layers, codes.transpose(0, 1), strict=True):
            assert isinstance(layer, _Layer)
            quantized = quantized + layer._codebook(layer_codes)
        out: torch.Tensor = self.output_proj(quantized)
        return out


class SplitQuantizer(nn.Module):
    """The first (semantic) codebook and the other 15, projected apart, then summed."""

    def __init__(self, quantizers: int, size: int, codebook_dim: int) -> None:
        super().__init__()
        self.rvq_first = ResidualQuantizer(1, size, codebook_dim // 2, codebook_dim)
        self.rvq_rest = ResidualQuantizer(quantizers - 1, size, codebook_dim // 2, codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        quantized: torch.Tensor = self.rvq_first(codes[:, :1])
        if codes.shape[1] > 1:
            quantized += self.rvq_rest(codes[:, 1:])
        return quantized


class PreTransformer(nn.Module):
    def __init__(self, config: Any, latent: int) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2WavTransformerModel,
        )

        self.input_proj = nn.Linear(latent, config.hidden_size)
        self.stack = Qwen3OmniMoeCode2WavTransformerModel._from_config(config)
        self.output_proj = nn.Linear(config.hidden_size, latent)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.stack(inputs_embeds=self.input_proj(hidden)).last_hidden_state
        projected: torch.Tensor = self.output_proj(out)
        return projected


class DecoderBlock(nn.Module):
    """SnakeBeta, an upsampling transposed convolution, three dilated residual units."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

        upsample = omni.Qwen3OmniMoeCausalTransConvNet(in_dim, out_dim, 2 * rate, rate)
        upsample.left_pad, upsample.right_pad = 0, rate  # k - s = rate, all on the right
        self.block = nn.ModuleList(
            [
                omni.Qwen3OmniMoeSnakeBeta(in_dim),
                upsample,
                *(omni.Qwen3OmniMoeCode2WavDecoderResidualUnit(out_dim, d) for d in (1, 3, 9)),
            ]
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for part in self.block:
            hidden = part(hidden)
        return hidden


class Code2WavModel(nn.Module):
    def __init__(self, decoder: dict[str, Any]) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
            Qwen3OmniMoeCode2WavConfig,
        )

        rates, ratios = list(decoder["upsample_rates"]), list(decoder["upsampling_ratios"])
        self.samples_per_frame = 1
        for rate in (*rates, *ratios):
            self.samples_per_frame *= int(rate)
        self.quantizers = int(decoder["num_quantizers"])
        # head_dim is not one of the config's declared fields, but its attention reads it
        # (the released decoder's 16 heads of 64 are not its hidden 512).
        config = Qwen3OmniMoeCode2WavConfig(  # type: ignore[call-arg]
            hidden_size=int(decoder["hidden_size"]),
            head_dim=int(decoder["head_dim"]),
            num_attention_heads=int(decoder["num_attention_heads"]),
            num_key_value_heads=int(decoder["num_key_value_heads"]),
            intermediate_size=int(decoder["intermediate_size"]),
            num_hidden_layers=int(decoder["num_hidden_layers"]),
            sliding_window=int(decoder["sliding_window"]),
            rms_norm_eps=float(decoder["rms_norm_eps"]),
            layer_scale_initial_scale=float(decoder["layer_scale_initial_scale"]),
            max_position_embeddings=int(decoder["max_position_embeddings"]),
            rope_parameters={"rope_type": "default", "rope_theta": float(decoder["rope_theta"])},
            attention_bias=bool(decoder.get("attention_bias", False)),
            hidden_act=decoder.get("hidden_act", "silu"),
        )
        latent, dim = int(decoder["latent_dim"]), int(decoder["decoder_dim"])
        codebook_dim = int(decoder["codebook_dim"])
        self.quantizer = SplitQuantizer(
            self.quantizers, int(decoder["codebook_size"]), codebook_dim
        )
        self.pre_conv = omni.Qwen3OmniMoeCausalConvNet(codebook_dim, latent, kernel_size=3)
        self.pre_transformer = PreTransformer(config, latent)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    omni.Qwen3OmniMoeCausalTransConvNet(latent, latent, ratio, ratio),
                    omni.Qwen3OmniMoeConvNeXtBlock(latent),
                ]
            )
            for ratio in ratios
        )
        blocks: list[nn.Module] = [omni.Qwen3OmniMoeCausalConvNet(latent, dim, 7)]
        blocks += [DecoderBlock(dim // 2**i, dim // 2 ** (i + 1), r) for i, r in enumerate(rates)]
        out = dim // 2 ** len(rates)
        blocks += [omni.Qwen3OmniMoeSnakeBeta(out), omni.Qwen3OmniMoeCausalConvNet(out, 1, 7)]
        self.decoder = nn.ModuleList(blocks)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B x quantizers x frames) -> audio (B x 1 x frames * samples_per_frame)."""
        if codes.shape[1] != self.quantizers:
            raise ValueError(f"expected {self.quantizers} codes a frame, not {codes.shape[1]}")
        hidden = self.pre_conv(self.quantizer(codes)).transpose(1, 2)
        hidden = self.pre_transformer(hidden).permute(0, 2, 1)
        for blocks in self.upsample:
            assert isinstance(blocks, nn.ModuleList)
            for block in blocks:
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        audio: torch.Tensor = hidden.clamp(min=-1, max=1)
        return audio


def load_code2wav(model_path: str, device: str | torch.device) -> Code2WavModel:
    root = Path(model_path) / FOLDER
    config = json.loads((root / "config.json").read_text())
    model = Code2WavModel(config["decoder_config"])
    from safetensors.torch import load_file

    weights = {
        name.removeprefix("decoder."): tensor
        for name, tensor in load_file(str(root / "model.safetensors")).items()
        if name.startswith("decoder.")
    }
    mapped = {_ours(name): tensor for name, tensor in weights.items()}
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{root}: not a Qwen3-TTS speech tokenizer this build reads (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]})"
        )
    return model.to(device).eval()


def _ours(name: str) -> str:
    # The transformer's layers and norm sit in transformers' stack, one level down.
    for part in ("layers.", "norm.", "rotary_emb."):
        if name.startswith(f"pre_transformer.{part}"):
            return "pre_transformer.stack." + name.removeprefix("pre_transformer.")
    return name
