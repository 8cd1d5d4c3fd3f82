"""tiny://cogvideox: CogVideoX-2b text to video (a pipeline no family splits) with tiny
random weights, saved as a diffusers checkpoint for the fallback's diffusers-video type.
It keeps the released geometry: the VAE is 8x down in space and 4x in time with 16
latent channels (so 4k+1 frames decode to 4k+1), the DiT patches 2x2 with sin-cos
positions (CogVideoX-2b's; the 5B's rotary ones are the other path) over T5's 226-token
context, and the scheduler is the released v-prediction DDIM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omnipipe.families.diffusers_any.tiny import VOCAB
from omnipipe.stagekit.tokenizer import save_byte_tokenizer

TEXT_DIM = 32
# CogVideoXPipeline pads every prompt to this many T5 tokens, and its DiT's text
# positions are as many.
MAX_TEXT_TOKENS = 226


def build_cogvideox(target: Path) -> None:
    """CogVideoXPipeline: T5 -> the 3D DiT (with DDIM) -> the causal 3D VAE."""
    import torch
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=VOCAB,
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=37,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",  # T5 v1.1's, as CogVideoX's T5-XXL
        )
    )
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        time_embed_dim=16,
        text_embed_dim=TEXT_DIM,
        num_layers=1,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=MAX_TEXT_TOKENS,
        # The released defaults (in latents: 720x480 at 49 frames), what a call that
        # names no size makes.
        sample_width=90,
        sample_height=60,
        sample_frames=49,
    )
    vae = AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 16, 16),
        latent_channels=16,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=4,
    )
    # CogVideoX-2b's scheduler_config.json.
    scheduler = CogVideoXDDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        set_alpha_to_one=True,
        snr_shift_scale=3.0,
        steps_offset=0,
        timestep_spacing="trailing",
    )
    pipe = CogVideoXPipeline(
        tokenizer=save_byte_tokenizer(target / "tokenizer", max_length=MAX_TEXT_TOKENS),
        text_encoder=t5,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    cast(Any, pipe).save_pretrained(str(target))
