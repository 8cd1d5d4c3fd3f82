"""A LoRA adapter of tiny://qwen2.5-omni's thinker with random weights, saved as PEFT saves
one (adapter_config.json, adapter_model.safetensors): what the thinker adapter tests and
demos load into vLLM."""

from __future__ import annotations

from pathlib import Path

# The thinker's attention projections; PEFT's names, under the whole model's ("thinker.").
TARGETS = r".*thinker\.model\.layers\.\d+\.self_attn\.(q_proj|v_proj)"


def save_tiny_thinker_lora(target: Path, seed: int, rank: int = 8) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omnipipe.checkpoints.tiny import resolve_model_path

    path = resolve_model_path("tiny://qwen2.5-omni")
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    # Random A and B (PEFT's default B is zeros, an adapter that changes nothing).
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(str(target))
    return target


def build_thinker_lora(target: Path) -> None:
    """tiny://qwen2.5-omni-lora."""
    save_tiny_thinker_lora(target, seed=1)
