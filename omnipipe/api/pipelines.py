"""Registered stage-graph types (from vLLM-Omni) and the rules a stage graph obeys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnipipe.api.spec import Engine, Role

if TYPE_CHECKING:
    from omnipipe.api.spec import OmniPipelineSpec

CUSTOM = "custom"


@dataclass(frozen=True)
class StageDefaults:
    """A stage as a pipeline type defines it before any user override."""

    name: str
    role: Role
    engine: Engine
    inputs: tuple[str, ...] = ()
    # GPUs per replica for a real model; tiny:// models always run on the CPU.
    gpus: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineType:
    name: str
    description: str
    stages: tuple[StageDefaults, ...]
    # Model ids this type serves, for error messages and docs.
    example_models: tuple[str, ...] = ()
    # What a checkpoint of this type says it is: its model_index.json `_class_name`
    # (diffusers) or its config.json `model_type` (transformers).
    checkpoints: tuple[str, ...] = ()

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)


def _omni(name: str, description: str, models: tuple[str, ...], checkpoint: str) -> PipelineType:
    return PipelineType(
        name=name,
        description=description,
        example_models=models,
        checkpoints=(checkpoint,),
        stages=(
            StageDefaults("thinker", Role.THINKER, Engine.VLLM),
            StageDefaults("talker", Role.TALKER, Engine.TRANSFORMERS, inputs=("thinker",)),
            StageDefaults("code2wav", Role.CODE2WAV, Engine.TRANSFORMERS, inputs=("talker",)),
        ),
    )


PIPELINE_TYPES: dict[str, PipelineType] = {
    p.name: p
    for p in (
        PipelineType(
            name="qwen-image",
            description="Text to image: text encoder (AR) -> DiT denoiser (true CFG) -> VAE.",
            example_models=("Qwen/Qwen-Image", "tiny://qwen-image"),
            checkpoints=("QwenImagePipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
        ),
        PipelineType(
            name="qwen-image-edit",
            description=(
                "Image editing: vision-language encoder (input image and edit prompt) and "
                "VAE encoder (input image) -> DiT denoiser (true CFG) -> VAE."
            ),
            example_models=("Qwen/Qwen-Image-Edit", "tiny://qwen-image-edit"),
            checkpoints=("QwenImageEditPipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("encode-image", Role.VAE_ENCODER, Engine.DIFFUSERS),
                StageDefaults(
                    "denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode", "encode-image")
                ),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
        ),
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
        ),
        _omni(
            "qwen2.5-omni",
            "Any to text and speech: thinker -> talker -> code2wav, streaming.",
            ("Qwen/Qwen2.5-Omni-7B", "tiny://qwen2.5-omni"),
            "qwen2_5_omni",
        ),
        _omni(
            "qwen3-omni",
            "Qwen3-Omni-MoE: thinker -> talker -> code2wav, streaming.",
            ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "tiny://qwen3-omni"),
            "qwen3_omni_moe",
        ),
    )
}

PIPELINE_TYPE_NAMES: tuple[str, ...] = (*PIPELINE_TYPES, CUSTOM)


def pipeline_for_checkpoint(kinds: Sequence[str]) -> str | None:
    """The pipeline type whose checkpoints say they are one of `kinds`."""
    for kind in kinds:
        for p in PIPELINE_TYPES.values():
            if kind in p.checkpoints:
                return p.name
    return None


def default_stage_names(pipeline: str) -> tuple[str, ...]:
    known = PIPELINE_TYPES.get(pipeline)
    return known.stage_names if known else ()


def stage_order(spec: OmniPipelineSpec) -> list[str]:
    """Default stages in their defined order, then added stages in list order."""
    defaults = default_stage_names(spec.pipeline)
    return [*defaults, *(s.name for s in spec.stages if s.name not in defaults)]


def check_stage_graph(spec: OmniPipelineSpec) -> None:
    """Raise ValueError naming the field when the stage graph is invalid.

    The same rules are CEL rules of the CRD (see ``omnipipe.api.crd``).
    """
    if spec.pipeline not in PIPELINE_TYPE_NAMES:
        raise ValueError(
            f"spec.pipeline: unknown pipeline type {spec.pipeline!r}; "
            f"supported: {', '.join(PIPELINE_TYPE_NAMES)}"
        )
    names = [s.name for s in spec.stages]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"spec.stages: duplicate stage names: {', '.join(duplicates)}")
    if spec.pipeline == CUSTOM and not spec.stages:
        raise ValueError("spec.stages: a custom pipeline must define at least one stage")
    defaults = default_stage_names(spec.pipeline)
    for stage in spec.stages:
        if stage.name not in defaults and (stage.role is None or stage.engine is None):
            raise ValueError(
                f"spec.stages[{stage.name}]: role and engine are required for a stage "
                f"the {spec.pipeline} pipeline does not define"
            )
    order = stage_order(spec)
    for stage in spec.stages:
        for upstream in stage.inputs or ():
            if upstream not in order:
                raise ValueError(
                    f"spec.stages[{stage.name}].inputs: {upstream!r} is not a stage of "
                    "this pipeline"
                )
            if order.index(upstream) >= order.index(stage.name):
                raise ValueError(
                    f"spec.stages[{stage.name}].inputs: {upstream!r} must be an earlier stage "
                    "(the stage graph may not have cycles)"
                )
