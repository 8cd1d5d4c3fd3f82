"""BAGEL's generate stage (the generation expert denoising latents over the think stage's
KV caches) and decode stage (the FLUX VAE)."""

from __future__ import annotations

import torch

from omnipipe.families.bagel.context import FULL, NO_IMAGE, NO_TEXT, image_markers
from omnipipe.families.bagel.flow import Conditions, FlowParams, denoise
from omnipipe.families.bagel.generator import BagelGenerator
from omnipipe.families.bagel.kv_blocks import (
    DEFAULT_TABLE_BLOCKS,
    LAYOUT,
    block_bytes,
    kv_dtype,
    unpack,
)
from omnipipe.families.bagel.mot import ContextKV
from omnipipe.families.bagel.params import flow_params, int_param
from omnipipe.families.bagel.vae import decode_latents, load_vae, to_image, unpatchify
from omnipipe.stagekit.image_output import encoded_image
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult
from omnipipe.transfer import BlockTable

# OpenAI's n: each image is one flow, run one after the other.
MAX_IMAGES = 10

UPSTREAM = "think"


def conditions(caches: dict[str, ContextKV], params: FlowParams, empty: ContextKV) -> Conditions:
    """The think stage's caches; a companion the CFG needs but that did not come had no
    tokens (BAGEL's empty context)."""
    full = caches.get(FULL)
    if full is None:
        raise StageInputError("the think stage sent no context cache")
    no_text = caches.get(NO_TEXT) or (empty if params.uses_text_cfg else None)
    no_image = caches.get(NO_IMAGE) or (full if params.uses_image_cfg else None)
    return Conditions(full=full, no_text=no_text, no_image=no_image)


class BagelGenerateStage(Stage):
    def load(self) -> None:
        from transformers import AutoTokenizer

        # bfloat16 on a GPU (the released weights' dtype); float32 on the CPU.
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.generator = BagelGenerator.from_pretrained(self.model_path, dtype).to(self.device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.markers = image_markers(tokenizer)
        llm = self.generator.config.llm
        empty = ContextKV.empty(llm, llm.num_hidden_layers, torch.float32)
        self.empty = ContextKV(empty.keys.to(self.device), empty.values.to(self.device))
        self.kv_dtype = kv_dtype(self.device)
        size = block_bytes(llm, llm.num_hidden_layers, self.kv_dtype)
        self.table = BlockTable(DEFAULT_TABLE_BLOCKS, size)

    def kv_block_table(self) -> BlockTable:
        return self.table

    def caches(self, job: StageJob) -> dict[str, ContextKV]:
        layout = job.inputs.get(UPSTREAM, {}).get(LAYOUT)
        if layout is None:
            raise StageInputError("the think stage sent no KV layout")
        llm = self.generator.config.llm
        try:
            caches = unpack(
                job.blocks.get(UPSTREAM, []), layout, llm, llm.num_hidden_layers, self.kv_dtype
            )
            return {
                name: ContextKV(c.keys.to(self.device), c.values.to(self.device))
                for name, c in caches.items()
            }
        except (ValueError, RuntimeError) as exc:
            raise StageInputError(f"the think stage's KV blocks do not fit: {exc}") from None

    def run(self, job: StageJob) -> StageResult:
        n = int_param(job.params, "n", 1, 1, MAX_IMAGES)
        caches: dict[str, ContextKV] | None = None
        latents = []
        for i in range(n):
            params = flow_params(job.params, i)
            try:
                self.generator.latent_grid(params.height, params.width)
            except ValueError as exc:
                raise StageInputError(str(exc)) from None
            caches = caches if caches is not None else self.caches(job)
            conds = conditions(caches, params, self.empty)
            latents.append(
                denoise(self.generator, conds, params, self.markers, self.progress, job.cancelled)
            )
        return StageResult(tensors={"latents": torch.stack(latents).float().cpu()})


class BagelDecodeStage(Stage):
    def load(self) -> None:
        from omnipipe.families.bagel.config import BagelConfig

        self.config = BagelConfig.from_pretrained(self.model_path)
        self.vae = load_vae(self.model_path).to(self.device)

    def run(self, job: StageJob) -> StageResult:
        step = self.config.pixels_per_token
        rows = int_param(job.params, "height", 1024, 16, 2048) // step
        cols = int_param(job.params, "width", 1024, 16, 2048) // step
        outputs = []
        for tokens in job.inputs["generate"]["latents"]:
            if job.cancelled.is_set():
                return StageResult()
            latents = unpatchify(
                tokens, rows, cols, self.config.latent_patch_size, self.config.latent_channels
            )
            image = to_image(decode_latents(self.vae, latents.to(self.device)))
            outputs.append(encoded_image(image, job.params))
            self.progress()
        return StageResult(outputs=outputs)
