"""tiny://flux2-dev, tiny://flux2-klein and tiny://flux2-klein-base: FLUX.2's architecture
(the Flux2 DiT, the Flux2 VAE with its latent batch norm, and the text encoder: Mistral
Small 3.1 with its Pixtral processor for dev, Qwen3 for klein) with tiny random weights,
saved as the released checkpoints are (model_index.json's `_class_name`, one folder per
component). The VAE keeps the released geometry (8x down, 32 latent channels patched 2x2
into the DiT's 128), so the DiT sees as many tokens at a size as the released model; the
text encoders have just enough layers for the ones the pipelines stack (dev's 10, 20 and
30, klein's 9, 18 and 27). dev embeds its guidance, klein does not; klein is
step-distilled as the released FLUX.2-klein-4B is (no CFG), klein-base is not (CFG with
the empty prompt as the negative, as FLUX.2-klein-base-4B)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

TEXT_DIM = 16
# The byte tokenizer's 256 bytes and its special tokens, rounded up.
VOCAB = 272
# Mistral's instruction markers and Pixtral's image tokens, after the pad token.
MISTRAL_TOKENS = (
    "<pad>",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "</s>",
)
MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else "
    "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}</s>{% endif %}{% endfor %}"
)
# Qwen3's template for one user turn; without thinking, an empty think block opens the
# answer, as Qwen3's released template writes it.
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_flux2_transformer(guidance_embeds: bool) -> Any:
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_DIM,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def tiny_flux2_vae() -> Any:
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    vae: Any = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=32,
        norm_num_groups=4,
    )
    # Trained statistics, not the fresh (0, 1): the decode must read them.
    bn = vae.bn
    bn.running_mean.copy_(torch.randn_like(bn.running_mean) * 0.1)
    bn.running_var.copy_(torch.rand_like(bn.running_var) + 0.5)
    return vae


def _mistral3(directory: Path) -> tuple[Any, Any]:
    """Mistral3ForConditionalGeneration (a tiny Pixtral vision tower beside the text
    model, as released) and its PixtralProcessor."""
    import torch
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    tokenizer = save_byte_tokenizer(
        directory,
        special_tokens=MISTRAL_TOKENS,
        named_tokens={"image_token": "[IMG]"},
    )
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=4, size={"longest_edge": 32}),
        tokenizer=tokenizer,
        patch_size=4,
        spatial_merge_size=2,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(directory))
    torch.manual_seed(0)
    config = Mistral3Config(
        text_config=MistralConfig(
            vocab_size=VOCAB,
            hidden_size=TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=30,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
        ),
        vision_config=PixtralVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            patch_size=4,
            image_size=32,
        ),
        image_token_index=cast(int, tokenizer.convert_tokens_to_ids("[IMG]")),
        spatial_merge_size=2,
    )
    return Mistral3ForConditionalGeneration(config), processor


def _qwen3(directory: Path) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    tokenizer = save_byte_tokenizer(directory)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=27,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
    )
    return Qwen3ForCausalLM(config), tokenizer


def _scheduler() -> Any:
    """FLUX.2's released scheduler: the shift (mu) comes from the pipeline's empirical
    fit of the image's token count and the step count, applied exponentially."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )


def build_flux2_dev(target: Path) -> None:
    from diffusers import Flux2Pipeline

    text_encoder, processor = _mistral3(target / "tokenizer")
    pipe = Flux2Pipeline(
        scheduler=_scheduler(),
        vae=tiny_flux2_vae(),
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=tiny_flux2_transformer(guidance_embeds=True),
    )
    cast(Any, pipe).save_pretrained(str(target))


def _build_klein(target: Path, is_distilled: bool) -> None:
    from diffusers import Flux2KleinPipeline

    text_encoder, tokenizer = _qwen3(target / "tokenizer")
    pipe = Flux2KleinPipeline(
        scheduler=_scheduler(),
        vae=tiny_flux2_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_flux2_transformer(guidance_embeds=False),
        is_distilled=is_distilled,
    )
    cast(Any, pipe).save_pretrained(str(target))


def build_flux2_klein(target: Path) -> None:
    """tiny://flux2-klein: step-distilled, as FLUX.2-klein-4B (guidance is ignored)."""
    _build_klein(target, is_distilled=True)


def build_flux2_klein_base(target: Path) -> None:
    """tiny://flux2-klein-base: not distilled, as FLUX.2-klein-base-4B (true CFG)."""
    _build_klein(target, is_distilled=False)
