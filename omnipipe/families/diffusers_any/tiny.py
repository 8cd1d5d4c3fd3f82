"""tiny://sd3 and tiny://sana: two pipelines that no family splits, Stable Diffusion 3's
and Sana's architectures with tiny random weights, saved as diffusers checkpoints, for
the fallback's tests. Each keeps its released geometry: SD3's VAE is 8x down with 16
latent channels and its DiT patches 2x2; Sana's DC-AE is 32x down with 32 latent
channels, and its DiT's sample size picks the resolution bins its pipeline snaps to."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omnipipe.stagekit.tiny_vae import tiny_image_vae
from omnipipe.stagekit.tokenizer import save_byte_tokenizer

# The byte tokenizer's 256 bytes and its special tokens, rounded up.
VOCAB = 272
CLIP_DIM = 32


def _clip(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=CLIP_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=CLIP_DIM,
            # The byte tokenizer's own (CLIP pools at its end token).
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def build_sd3(target: Path) -> None:
    """StableDiffusion3Pipeline: two CLIP encoders and T5 -> the MMDiT -> the VAE."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    # The two CLIPs' sequences, side by side, are padded to T5's width.
    t5_dim = 2 * CLIP_DIM
    tokenizer = save_byte_tokenizer(target / "tokenizer", max_length=77)
    tokenizer_2 = save_byte_tokenizer(target / "tokenizer_2", max_length=77)
    clip, clip_2 = _clip(tokenizer), _clip(tokenizer_2)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=VOCAB,
            d_model=t5_dim,
            d_kv=8,
            d_ff=37,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
        )
    )
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=t5_dim,
        caption_projection_dim=32,
        pooled_projection_dim=2 * CLIP_DIM,
        out_channels=16,
        pos_embed_max_size=192,
    )
    vae = tiny_image_vae(scaling_factor=1.5305, shift_factor=0.0609)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=clip_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=t5,
        tokenizer_3=save_byte_tokenizer(target / "tokenizer_3", max_length=256),
    )
    cast(Any, pipe).save_pretrained(str(target))


def build_sana(target: Path) -> None:
    """SanaPipeline: a Gemma 2 encoder -> the linear-attention DiT -> the DC-AE."""
    import torch
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    text_dim = 32
    gemma = Gemma2Model(
        Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=text_dim,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=2048,
            pad_token_id=0,
        )
    )
    blocks = 6  # 32x down, as released
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=32,
        attention_head_dim=8,
        encoder_block_types=("ResBlock",) * blocks,
        decoder_block_types=("ResBlock",) * blocks,
        # The deepest block as wide as the latent: the shortcuts to and from the latent
        # group or repeat its channels.
        encoder_block_out_channels=(8, 8, 8, 16, 16, 32),
        decoder_block_out_channels=(8, 8, 8, 16, 16, 32),
        encoder_layers_per_block=(1,) * blocks,
        decoder_layers_per_block=(1,) * blocks,
        encoder_qkv_multiscales=((),) * blocks,
        decoder_qkv_multiscales=((),) * blocks,
        scaling_factor=0.41407,
    )
    transformer = SanaTransformer2DModel(
        in_channels=32,
        out_channels=32,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=text_dim,
        # 16: its pipeline snaps sizes to the 512 px bins (32 the 1024 px ones).
        sample_size=16,
        patch_size=1,
    )
    scheduler = DPMSolverMultistepScheduler(
        flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction"
    )
    pipe = SanaPipeline(
        # Its pipeline reads 300 tokens of the prompt, after its long instruction.
        tokenizer=save_byte_tokenizer(target / "tokenizer", max_length=8192),
        text_encoder=gemma,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    cast(Any, pipe).save_pretrained(str(target))
