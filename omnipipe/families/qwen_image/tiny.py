"""tiny://qwen-image: Qwen-Image's architecture (the DiT, the VAE and the Qwen2.5-VL text
encoder) with tiny random weights, saved as a diffusers checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast


def tiny_qwen_image_transformer() -> Any:
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )


def tiny_qwen_image_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    # The released VAE's shape (8x down, three stages, temporal downsampling as released)
    # with few channels: the DiT then sees as many tokens as the real model at a size, and
    # a 2048x2048 decode stays seconds on a CPU.
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )


def tiny_qwen_image_text_encoder(**vision_token_ids: Any) -> Any:
    """Qwen2.5-VL at the size both tiny Qwen-Image checkpoints use; the edit encoder,
    which sees images, names its tokenizer's vision tokens."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"},
                "rope_theta": 1000000.0,
                "vocab_size": 512,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 16,
            },
            **vision_token_ids,
        )
    )


def build_qwen_image(target: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    transformer = tiny_qwen_image_transformer()
    vae = tiny_qwen_image_vae()
    text_encoder = tiny_qwen_image_text_encoder()
    tokenizer = save_byte_tokenizer(target / "tokenizer")
    pipe = QwenImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    cast(Any, pipe).save_pretrained(str(target))
