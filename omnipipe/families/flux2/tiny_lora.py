"""tiny://flux2-dev-lora: a LoRA adapter of tiny://flux2-dev's DiT with random weights."""

from __future__ import annotations

from pathlib import Path

from omnipipe.stagekit.tiny_lora import save_random_lora

# The double-stream blocks' attention projections and the single-stream blocks' fused
# one, as FLUX.2 LoRAs are trained.
TARGETS = ("to_q", "to_k", "to_v", "to_qkv_mlp_proj")


def save_tiny_flux2_lora(target: Path, seed: int, rank: int = 4, alpha: int = 8) -> Path:
    return save_random_lora(target, "tiny://flux2-dev", TARGETS, seed, rank, alpha)


def build_flux2_dev_lora(target: Path) -> None:
    save_tiny_flux2_lora(target, seed=1)
