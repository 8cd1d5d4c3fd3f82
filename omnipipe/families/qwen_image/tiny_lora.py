"""A LoRA adapter of tiny://qwen-image's DiT with random weights, saved as diffusers
saves one (pytorch_lora_weights.safetensors): what the adapter tests and demos load."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def save_tiny_lora(target: Path, seed: int, rank: int = 4) -> Path:
    import torch
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    from omnipipe.checkpoints.tiny import resolve_model_path

    path = resolve_model_path("tiny://qwen-image")
    transformer = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer")
    torch.manual_seed(seed)
    # Random A and B (PEFT's default B is zeros, an adapter that changes nothing).
    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS), init_lora_weights=False)
    )
    layers = get_peft_model_state_dict(transformer)
    cast(Any, QwenImagePipeline).save_lora_weights(str(target), transformer_lora_layers=layers)
    return target


def build_lora(target: Path) -> None:
    """tiny://qwen-image-lora."""
    save_tiny_lora(target, seed=1)


def build_lora_2(target: Path) -> None:
    """tiny://qwen-image-lora-2: another adapter, so two can differ."""
    save_tiny_lora(target, seed=2)
