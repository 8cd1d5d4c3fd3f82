"""Z-Image's pipeline, loaded with only the components a stage runs (the Qwen3 encoder
alone is 4B released)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.stagekit.pipeline_parts import load_pipeline_parts

PIPELINE_CLASS = "ZImagePipeline"


def load_z_image(model_path: str, device: torch.device, keep: set[str]) -> Any:
    return load_pipeline_parts(model_path, device, keep, (PIPELINE_CLASS,))
