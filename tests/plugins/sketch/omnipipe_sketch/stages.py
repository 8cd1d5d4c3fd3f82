"""The sketch family's stages: Qwen-Image's, loading the diffusers pipeline that a sketch
checkpoint keeps in its pipeline/ folder."""

from __future__ import annotations

from pathlib import Path

from omnipipe.api import ResolvedStage
from omnipipe.families.qwen_image.denoise import SteppedDenoiseStage
from omnipipe.families.qwen_image.stages import DecodeStage, TextEncodeStage

PIPELINE_DIR = "pipeline"


class SketchEncode(TextEncodeStage):
    def __init__(self, spec: ResolvedStage, model_path: str, device: str) -> None:
        super().__init__(spec, str(Path(model_path) / PIPELINE_DIR), device)


class SketchDenoise(SteppedDenoiseStage):
    def __init__(self, spec: ResolvedStage, model_path: str, device: str) -> None:
        super().__init__(spec, str(Path(model_path) / PIPELINE_DIR), device)


class SketchDecode(DecodeStage):
    def __init__(self, spec: ResolvedStage, model_path: str, device: str) -> None:
        super().__init__(spec, str(Path(model_path) / PIPELINE_DIR), device)
