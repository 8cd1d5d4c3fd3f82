"""tiny://flux1-dev, tiny://flux1-schnell and tiny://flux1-kontext: FLUX.1's
architecture (the DiT, the VAE, the CLIP and T5 text encoders) with tiny random weights,
saved as diffusers checkpoints. The VAE keeps the released geometry (8x down, 16 latent
channels, its scale and shift), so the DiT sees as many tokens at a size as the released
model; dev and Kontext embed their guidance, schnell does not, as released."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omnipipe.stagekit.tiny_vae import tiny_image_vae
from omnipipe.stagekit.tokenizer import save_byte_tokenizer

# The byte tokenizer's 256 bytes and its special tokens, rounded up.
VOCAB = 272
TEXT_DIM = 32


def tiny_flux_transformer(guidance_embeds: bool) -> Any:
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )


def tiny_text_encoders() -> tuple[Any, Any]:
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=TEXT_DIM,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=VOCAB,
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
        )
    )
    return clip, t5


def _build(target: Path, guidance_embeds: bool, pipeline_class: str = "FluxPipeline") -> None:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    clip, t5 = tiny_text_encoders()
    # The released schedulers: dev's shift follows the image's token count; schnell's is
    # fixed at 1 (no shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0 if guidance_embeds else 1.0,
        use_dynamic_shifting=guidance_embeds,
    )
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=scheduler,
        vae=tiny_image_vae(),
        text_encoder=clip,
        tokenizer=save_byte_tokenizer(target / "tokenizer", max_length=77),
        text_encoder_2=t5,
        tokenizer_2=save_byte_tokenizer(target / "tokenizer_2", max_length=512),
        transformer=tiny_flux_transformer(guidance_embeds),
    )
    cast(Any, pipe).save_pretrained(str(target))


def build_flux1_dev(target: Path) -> None:
    _build(target, guidance_embeds=True)


def build_flux1_schnell(target: Path) -> None:
    _build(target, guidance_embeds=False)


def build_flux1_kontext(target: Path) -> None:
    """tiny://flux1-kontext: FluxKontextPipeline over dev's tiny components, as the
    released FLUX.1-Kontext-dev is dev's architecture with other weights."""
    _build(target, guidance_embeds=True, pipeline_class="FluxKontextPipeline")
