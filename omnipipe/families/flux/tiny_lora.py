"""A LoRA adapter of tiny://flux1-dev's DiT with random weights, saved as diffusers saves
one (pytorch_lora_weights.safetensors): what the adapter tests and demos load."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

# The attention projections of the double- and single-stream blocks alike.
TARGETS = ("to_q", "to_k", "to_v")


def save_tiny_flux_lora(target: Path, seed: int, rank: int = 4, alpha: int = 8) -> Path:
    """alpha is not the rank, as in many trained adapters: its strength (alpha / rank)
    lives in the saved config, which a loader must read to apply it as diffusers does."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    from omnipipe.checkpoints.tiny import resolve_model_path

    path = resolve_model_path("tiny://flux1-dev")
    transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer")
    torch.manual_seed(seed)
    # Random A and B (PEFT's default B is zeros, an adapter that changes nothing).
    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS), init_lora_weights=False)
    )
    layers = get_peft_model_state_dict(transformer)
    cast(Any, FluxPipeline).save_lora_weights(
        str(target),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
    )
    return target


def build_flux1_dev_lora(target: Path) -> None:
    """tiny://flux1-dev-lora."""
    save_tiny_flux_lora(target, seed=1)
