"""BAGEL, written from the published architecture (ByteDance-Seed/Bagel): the
mixture-of-transformers LLM whose generation expert denoises VAE latents with attention
over the understanding expert's KV cache, flow matching with a timestep shift, CFG over
text and image conditions, and the FLUX-style VAE. vLLM runs the understanding side (the
think stage); the other modules here read the same checkpoint."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

IMAGE = "omnipipe.families.bagel.image"

FAMILY = Family(
    name="bagel",
    description="BAGEL: an AR model that thinks, a DiT generator over its KV cache, a VAE.",
    pipelines=(
        PipelineType(
            name="bagel",
            description=(
                "BAGEL (AR main, DiT generator): think (vLLM; text answers, and the KV "
                "cache of an image's context and its CFG companions) -> generate (the "
                "generation expert over those caches, flow matching) -> decode (VAE)."
            ),
            example_models=("ByteDance-Seed/BAGEL-7B-MoT", "tiny://bagel"),
            checkpoints=("bagel",),
            stages=(
                StageDefaults("think", Role.THINKER, Engine.VLLM),
                StageDefaults("generate", Role.DENOISER, Engine.DIFFUSERS, inputs=("think",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("generate",)),
            ),
            stage_classes={
                (Role.THINKER, Engine.VLLM): "omnipipe.families.bagel.think:BagelThinkStage",
                (Role.DENOISER, Engine.DIFFUSERS): f"{IMAGE}:BagelGenerateStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{IMAGE}:BagelDecodeStage",
            },
        ),
    ),
    tiny_models={"bagel": "omnipipe.families.bagel.tiny:build_bagel"},
    requests="omnipipe.families.bagel.requests:EXTENSIONS",
)
