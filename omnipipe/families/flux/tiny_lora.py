"""tiny://flux1-dev-lora: a LoRA adapter of tiny://flux1-dev's DiT with random weights."""

from __future__ import annotations

from pathlib import Path

from omnipipe.stagekit.tiny_lora import save_random_lora

# The attention projections of the double- and single-stream blocks alike.
TARGETS = ("to_q", "to_k", "to_v")


def save_tiny_flux_lora(target: Path, seed: int, rank: int = 4, alpha: int = 8) -> Path:
    return save_random_lora(target, "tiny://flux1-dev", TARGETS, seed, rank, alpha)


def build_flux1_dev_lora(target: Path) -> None:
    save_tiny_flux_lora(target, seed=1)
