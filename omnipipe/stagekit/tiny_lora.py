"""A LoRA adapter of a tiny checkpoint's DiT with random weights, saved as diffusers saves
one (pytorch_lora_weights.safetensors): what the families' adapter tests and demos load
(tiny://flux1-dev-lora, tiny://qwen-image-lora, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def save_random_lora(
    target: Path,
    model: str,
    targets: Sequence[str],
    seed: int,
    rank: int = 4,
    alpha: int | None = None,
) -> Path:
    """An adapter of `model`'s transformer on the modules named `targets`. With an
    `alpha` other than the rank, as in many trained adapters, its strength (alpha / rank)
    lives in the saved metadata, which a loader must read to apply it as diffusers does."""
    import diffusers
    import torch
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from omnipipe.checkpoints.tiny import resolve_model_path

    path = resolve_model_path(model)
    index = DiffusionPipeline.load_config(path)
    pipeline: Any = getattr(diffusers, str(index["_class_name"]))
    transformer_class: Any = getattr(diffusers, str(index["transformer"][1]))
    transformer = transformer_class.from_pretrained(path, subfolder="transformer")
    torch.manual_seed(seed)
    # Random A and B (PEFT's default B is zeros, an adapter that changes nothing).
    transformer.add_adapter(
        LoraConfig(
            r=rank,
            lora_alpha=rank if alpha is None else alpha,
            target_modules=list(targets),
            init_lora_weights=False,
        )
    )
    layers = get_peft_model_state_dict(transformer)
    metadata = (
        {}
        if alpha is None
        else {"transformer_lora_adapter_metadata": transformer.peft_config["default"].to_dict()}
    )
    pipeline.save_lora_weights(str(target), transformer_lora_layers=layers, **metadata)
    return target
