"""tiny://z-image-lora: a LoRA adapter of tiny://z-image's DiT with random weights."""

from __future__ import annotations

from pathlib import Path

from omnipipe.stagekit.tiny_lora import save_random_lora

# The attention projections of the refiner and main blocks alike.
TARGETS = ("to_q", "to_k", "to_v")


def save_tiny_z_image_lora(target: Path, seed: int, rank: int = 4, alpha: int = 8) -> Path:
    return save_random_lora(target, "tiny://z-image", TARGETS, seed, rank, alpha)


def build_z_image_lora(target: Path) -> None:
    save_tiny_z_image_lora(target, seed=1)
