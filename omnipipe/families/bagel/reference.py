"""BAGEL image generation in one process from the same modules and weights: the contexts
(text, and input images through the ViT) prefilled by our understanding expert (no
vLLM), denoised, decoded. The split graph's image must equal this one's."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.bagel.context import (
    FULL,
    NO_IMAGE,
    NO_TEXT,
    Prompt,
    Turn,
    image_contexts,
    image_markers,
    token_id,
)
from omnipipe.families.bagel.flow import Conditions, FlowParams, denoise
from omnipipe.families.bagel.generator import BagelGenerator
from omnipipe.families.bagel.mot import ContextKV
from omnipipe.families.bagel.vae import decode_latents, load_vae, to_png, unpatchify


def prefill_text(generator: BagelGenerator, tokenizer: Any, text: str) -> ContextKV:
    ids = torch.tensor(tokenizer(text).input_ids)
    lm = generator.language_model.model
    with torch.inference_mode():
        return lm.prefill(lm.embed_tokens(ids))


def prefill_prompt(
    generator: BagelGenerator, vision: Any, processor: Any, tokenizer: Any, prompt: Prompt
) -> ContextKV:
    """A context with images: each <|image_pad|> becomes the ViT's tokens, as vLLM's
    processor expands it, and their embeddings replace the pads'."""
    pad = token_id(tokenizer, "<|image_pad|>")
    ids = tokenizer(prompt.text).input_ids
    lm = generator.language_model.model
    with torch.inference_mode():
        images = iter(
            vision(processor(prompt.images, return_tensors="pt").pixel_values)
            if prompt.images
            else []
        )
        parts = []
        for token in ids:
            parts.append(next(images) if token == pad else lm.embed_tokens(torch.tensor([token])))
        return lm.prefill(torch.cat(parts))


def generate_image(
    model_path: str, turns: list[Turn], images: list[Any], params: FlowParams
) -> bytes:
    """An image over a conversation (text and input images), in one process."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from omnipipe.families.bagel.config import BagelConfig
    from omnipipe.families.bagel.vision import BagelVision

    generator = BagelGenerator.from_pretrained(model_path)
    vision = BagelVision.from_pretrained(model_path)
    processor = AutoImageProcessor.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    llm = generator.config.llm
    prompts = image_contexts(turns, images, params.uses_text_cfg, params.uses_image_cfg)
    caches = {
        name: prefill_prompt(generator, vision, processor, tokenizer, p)
        if not p.empty
        else ContextKV.empty(llm, llm.num_hidden_layers, torch.float32)
        for name, p in prompts.items()
    }
    full = caches[FULL]
    conditions = Conditions(
        full=full,
        no_text=caches.get(NO_TEXT),
        no_image=caches.get(NO_IMAGE, full) if params.uses_image_cfg else None,
    )
    tokens = denoise(generator, conditions, params, image_markers(tokenizer))
    config = BagelConfig.from_pretrained(model_path)
    rows, cols = generator.latent_grid(params.height, params.width)
    latents = unpatchify(tokens, rows, cols, config.latent_patch_size, config.latent_channels)
    return to_png(decode_latents(load_vae(model_path), latents))


def text_to_image(model_path: str, prompt: str, params: FlowParams) -> bytes:
    return generate_image(model_path, [Turn("user", (prompt,))], [], params)
