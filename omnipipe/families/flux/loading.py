"""FLUX.1's pipelines, loaded with only the components a stage runs (the T5 encoder alone
is 4.7B released)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.stagekit.pipeline_parts import load_pipeline_parts

FLUX = "FluxPipeline"
KONTEXT = "FluxKontextPipeline"  # FLUX.1 Kontext: dev's DiT, editing an input image
PIPELINE_CLASSES = (FLUX, KONTEXT)


def load_flux(model_path: str, device: torch.device, keep: set[str]) -> Any:
    return load_pipeline_parts(model_path, device, keep, PIPELINE_CLASSES)
