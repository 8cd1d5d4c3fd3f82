"""BAGEL text-to-image in one process from the same modules and weights: the contexts
prefilled by our understanding expert (no vLLM), denoised, decoded. The split graph's
image must equal this one's."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.worker.bagel.context import (
    FULL,
    NO_IMAGE,
    NO_TEXT,
    Turn,
    image_contexts,
    image_markers,
)
from omnipipe.worker.bagel.flow import Conditions, FlowParams, denoise
from omnipipe.worker.bagel.generator import BagelGenerator
from omnipipe.worker.bagel.mot import ContextKV
from omnipipe.worker.bagel.vae import decode_latents, load_vae, to_png, unpatchify


def prefill_text(generator: BagelGenerator, tokenizer: Any, text: str) -> ContextKV:
    ids = torch.tensor(tokenizer(text).input_ids)
    lm = generator.language_model.model
    with torch.inference_mode():
        return lm.prefill(lm.embed_tokens(ids))


def text_to_image(model_path: str, prompt: str, params: FlowParams) -> bytes:
    from transformers import AutoTokenizer

    from omnipipe.worker.bagel.config import BagelConfig

    generator = BagelGenerator.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    llm = generator.config.llm
    prompts = image_contexts(
        [Turn("user", (prompt,))], [], params.uses_text_cfg, params.uses_image_cfg
    )
    caches = {
        name: prefill_text(generator, tokenizer, p.text)
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
    markers = image_markers(tokenizer)
    tokens = denoise(generator, conditions, params, markers)
    config = BagelConfig.from_pretrained(model_path)
    rows, cols = generator.latent_grid(params.height, params.width)
    latents = unpatchify(tokens, rows, cols, config.latent_patch_size, config.latent_channels)
    return to_png(decode_latents(load_vae(model_path), latents))
