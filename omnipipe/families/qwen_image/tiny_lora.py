"""tiny://qwen-image-lora and -lora-2: LoRA adapters of tiny://qwen-image's DiT with
random weights (two, so that adapters can differ)."""

from __future__ import annotations

from pathlib import Path

from omnipipe.stagekit.tiny_lora import save_random_lora

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def save_tiny_lora(target: Path, seed: int, rank: int = 4) -> Path:
    return save_random_lora(target, "tiny://qwen-image", TARGETS, seed, rank)


def build_lora(target: Path) -> None:
    save_tiny_lora(target, seed=1)


def build_lora_2(target: Path) -> None:
    save_tiny_lora(target, seed=2)
