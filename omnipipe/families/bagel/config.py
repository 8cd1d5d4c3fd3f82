"""The parts of a BAGEL checkpoint's config.json the generation side needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LlmShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # BAGEL's layers RMS-normalise each head's queries and keys before the rotary
    # embedding (vLLM's Qwen2 reads the same flag).
    qk_norm: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class BagelConfig:
    llm: LlmShape
    latent_channels: int  # the VAE's z channels
    vae_downsample: int  # pixels per latent, per side
    latent_patch_size: int  # latents per generation token, per side
    max_latent_size: int  # latent_pos_embed's grid side, in tokens
    timestep_shift: float

    @property
    def patch_dim(self) -> int:
        return self.latent_patch_size**2 * self.latent_channels

    @property
    def pixels_per_token(self) -> int:
        return self.vae_downsample * self.latent_patch_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BagelConfig:
        llm = raw["llm_config"]
        rope = llm.get("rope_parameters") or llm.get("rope_scaling") or {}
        vae = raw.get("vae_config") or {"z_channels": 16, "downsample": 8}
        return cls(
            llm=LlmShape(
                hidden_size=int(llm["hidden_size"]),
                intermediate_size=int(llm["intermediate_size"]),
                num_hidden_layers=int(llm["num_hidden_layers"]),
                num_attention_heads=int(llm["num_attention_heads"]),
                num_key_value_heads=int(llm.get("num_key_value_heads", llm["num_attention_heads"])),
                vocab_size=int(llm["vocab_size"]),
                rms_norm_eps=float(llm.get("rms_norm_eps", 1e-6)),
                rope_theta=float(llm.get("rope_theta", rope.get("rope_theta", 10000.0))),
                qk_norm=bool(llm.get("qk_norm", False)),
            ),
            latent_channels=int(vae["z_channels"]),
            vae_downsample=int(vae["downsample"]),
            latent_patch_size=int(raw.get("latent_patch_size", 2)),
            max_latent_size=int(raw.get("max_latent_size", 32)),
            timestep_shift=float(raw.get("timestep_shift", 1.0)),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> BagelConfig:
        with (Path(path) / "config.json").open() as f:
            return cls.from_dict(json.load(f))


def understanding_image_tokens(path: str | Path) -> int:
    """The tokens of one image in the think stage's prompt: vLLM's BAGEL expands every
    image, whatever its size (its SigLIP processor resizes it), into the ViT's whole grid
    of vit_max_num_patch_per_side squared."""
    with (Path(path) / "config.json").open() as f:
        raw = json.load(f)
    return int(raw.get("vit_max_num_patch_per_side", 70)) ** 2
