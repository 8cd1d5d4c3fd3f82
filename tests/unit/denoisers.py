"""tiny://qwen-image's stages loaded as the worker loads them, with a denoiser's
acceleration settings, for the acceleration tests."""

from __future__ import annotations

from typing import Any

from omnipipe.api import ResolvedPipeline, ResolvedStage, parse_resource, resolve
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import StageJob
from omnipipe.worker.stage_classes import stage_class


def pipeline(
    acceleration: dict[str, Any] | None, adapters: list[dict[str, Any]] | None = None
) -> ResolvedPipeline:
    stages = [{"name": "denoise", "acceleration": acceleration}] if acceleration else []
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "img"},
                "spec": {
                    "model": "tiny://qwen-image",
                    "pipeline": "qwen-image",
                    "stages": stages,
                    "adapters": adapters or [],
                },
            }
        )
    )


def loaded(spec: ResolvedStage) -> Any:
    path = resolve_model_path("tiny://qwen-image")
    stage = stage_class(spec, path)(spec, path, "cpu")
    stage.load()
    return stage


def encoded(params: list[dict[str, Any]]) -> list[StageJob]:
    """Denoiser jobs for `params`, their prompts through the text encoder."""
    encode = loaded(pipeline(None).stage("encode"))
    return [StageJob(p, {"encode": encode.run(StageJob(p, {})).tensors}) for p in params]
