"""FLUX.2's pipelines, loaded with only the components a stage runs (dev's text encoder
alone is 24B released)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.stagekit.pipeline_parts import load_pipeline_parts

DEV = "Flux2Pipeline"  # FLUX.2 dev: Mistral Small 3.1, guidance distilled into the DiT
KLEIN = "Flux2KleinPipeline"  # FLUX.2 klein: Qwen3, true CFG unless step-distilled
PIPELINE_CLASSES = (DEV, KLEIN)


def load_flux2(model_path: str, device: torch.device, keep: set[str]) -> Any:
    return load_pipeline_parts(model_path, device, keep, PIPELINE_CLASSES)


def runs_cfg(pipe: Any) -> bool:
    """Whether the pipeline runs true CFG with a negative prompt: klein does, unless it is
    step-distilled (Flux2KleinPipeline.do_classifier_free_guidance); dev's guidance is the
    DiT's input instead."""
    return type(pipe).__name__ == KLEIN and not pipe.config.get("is_distilled", False)
