"""tiny://bagel: BAGEL's layout with tiny random weights, made offline.

One model.safetensors holds what vLLM's BagelForConditionalGeneration loads (the Qwen2
understanding expert, lm_head, the SigLIP ViT, the connector) and the generation weights
it skips (`*_moe_gen`, time_embedder, vae2llm, llm2vae, latent_pos_embed), which our
generator reads. Beside it: config.json (model_type bagel), the offline byte tokenizer,
a SigLIP image processor, and the FLUX-shaped VAE as a diffusers AutoencoderKL in vae/.

Sizes: vLLM's CPU attention needs head_dim >= 32; the ViT's 32-pixel image in 8-pixel
patches is 16 tokens, which must equal vit_max_num_patch_per_side**2 (vLLM reserves that
many placeholder tokens per image)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnipipe.stagekit.tokenizer import save_byte_tokenizer

LLM_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "qk_norm": True,
}
VIT_IMAGE_SIZE, VIT_PATCH = 32, 8
VIT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": VIT_IMAGE_SIZE,
    "patch_size": VIT_PATCH,
    "num_channels": 3,
    "vision_use_head": False,
}
LATENT_CHANNELS = 4


def bagel_config() -> dict[str, Any]:
    return {
        "model_type": "bagel",
        "architectures": ["BagelForConditionalGeneration"],
        "visual_gen": True,
        "visual_und": True,
        "llm_config": LLM_CONFIG,
        "vit_config": VIT_CONFIG,
        "vae_config": {"z_channels": LATENT_CHANNELS, "downsample": 8},
        "latent_patch_size": 2,
        "max_latent_size": 16,
        "vit_max_num_patch_per_side": VIT_IMAGE_SIZE // VIT_PATCH,
        "connector_act": "gelu_pytorch_tanh",
        "timestep_shift": 1.0,
        "torch_dtype": "float32",
    }


def build_bagel(target: Path) -> None:
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    from omnipipe.families.bagel.config import BagelConfig
    from omnipipe.families.bagel.generator import WEIGHTS_FILE, BagelGenerator

    target.mkdir(parents=True, exist_ok=True)
    raw = bagel_config()
    torch.manual_seed(0)
    generator = BagelGenerator(BagelConfig.from_dict(raw))
    hidden = LLM_CONFIG["hidden_size"]
    weights = {k: v.detach().clone().contiguous() for k, v in generator.state_dict().items()}
    for name, value in weights.items():
        if "norm" in name:
            # Not all ones (the initial value): a norm weight read wrongly then shows.
            value.add_(0.1 * torch.randn(value.shape))
    lm_head = torch.nn.Linear(hidden, LLM_CONFIG["vocab_size"], bias=False)
    weights["language_model.lm_head.weight"] = lm_head.weight.detach().clone()
    vit = SiglipVisionModel(SiglipVisionConfig(**VIT_CONFIG))
    for k, v in vit.state_dict().items():
        # The checkpoint keeps SigLIP's own prefix, which transformers 5 drops.
        name = k if k.startswith("vision_model.") else f"vision_model.{k}"
        weights[f"vit_model.{name}"] = v.detach().clone().contiguous()
    for name, shape in (("fc1", (hidden, VIT_CONFIG["hidden_size"])), ("fc2", (hidden, hidden))):
        layer = torch.nn.Linear(shape[1], shape[0])
        weights[f"connector.{name}.weight"] = layer.weight.detach().clone()
        weights[f"connector.{name}.bias"] = layer.bias.detach().clone()
    save_file(weights, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    save_byte_tokenizer(target)
    SiglipImageProcessor(size={"height": VIT_IMAGE_SIZE, "width": VIT_IMAGE_SIZE}).save_pretrained(
        str(target)
    )
    vae: Any = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        # FLUX's latent normalisation.
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    vae.save_pretrained(str(target / "vae"))
