"""tiny://z-image and tiny://z-image-turbo: Z-Image's released layout (ZImagePipeline
with the ZImageTransformer2DModel DiT, a Qwen3Model text encoder and its Qwen2Tokenizer
with a chat template, the FLUX-style AutoencoderKL and FlowMatchEulerDiscreteScheduler)
with tiny random weights, saved as diffusers checkpoints. The two released checkpoints
differ only in their weights and their scheduler's fixed shift (6.0 for Z-Image, 3.0 for
the distilled Turbo); their DiT, encoder and VAE configs are the same, so the two tiny
ones share weights and differ where the released ones do. The VAE keeps the released
geometry (8x down, 16 latent channels, its scale and shift), so the DiT sees as many
tokens at a size as the released model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omnipipe.stagekit.tiny_vae import tiny_image_vae

# The byte tokenizer's 256 bytes and its special tokens, rounded up.
VOCAB = 272
TEXT_DIM = 32
# Qwen3's chat template on the path ZImagePipeline takes (one user message, a generation
# prompt, enable_thinking): the released one's output for it, and the empty thinking
# block it adds when thinking is off.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# The released schedulers' fixed shifts (no dynamic shifting in either).
Z_IMAGE_SHIFT, TURBO_SHIFT = 6.0, 3.0


def tiny_z_image_transformer() -> Any:
    import torch
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_DIM,
        axes_dims=[4, 6, 6],
        axes_lens=[1024, 512, 512],
    )


def tiny_z_image_text_encoder() -> Any:
    """Qwen3 (the released 4B's shape of grouped-query attention) at a tiny size; the
    pipeline reads its second-to-last hidden state."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    return Qwen3Model(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=TEXT_DIM,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )


def _tokenizer(directory: Path) -> Any:
    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    tokenizer = save_byte_tokenizer(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def _build(target: Path, shift: float) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False
        ),
        vae=tiny_image_vae(force_upcast=True),
        text_encoder=tiny_z_image_text_encoder(),
        tokenizer=_tokenizer(target / "tokenizer"),
        transformer=tiny_z_image_transformer(),
    )
    cast(Any, pipe).save_pretrained(str(target))


def build_z_image(target: Path) -> None:
    """tiny://z-image: the base model's layout (CFG with a negative prompt)."""
    _build(target, Z_IMAGE_SHIFT)


def build_z_image_turbo(target: Path) -> None:
    """tiny://z-image-turbo: Turbo's layout, the same but for its scheduler's shift."""
    _build(target, TURBO_SHIFT)
