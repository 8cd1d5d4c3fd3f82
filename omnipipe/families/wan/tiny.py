"""tiny://wan: Wan 2.1 text-to-video's architecture (the UMT5 text encoder, the Wan DiT and
the Wan VAE) with tiny random weights, saved as a diffusers checkpoint. The VAE keeps the
released model's geometry (8x down in space, 4x in time), so frame counts and sizes are
checked as they are for the real model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast


def tiny_wan_transformer() -> Any:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=64,
    )


def tiny_wan_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )


def tiny_umt5() -> Any:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=512,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
        )
    )


def build_wan(target: Path) -> None:
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    # The released Wan 2.1 T2V scheduler: UniPC on flow sigmas, shift 3 (480p).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = WanPipeline(
        tokenizer=save_byte_tokenizer(target / "tokenizer"),
        text_encoder=tiny_umt5(),
        transformer=tiny_wan_transformer(),
        vae=tiny_wan_vae(),
        scheduler=scheduler,
    )
    cast(Any, pipe).save_pretrained(str(target))
