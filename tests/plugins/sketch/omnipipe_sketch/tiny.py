"""tiny://sketch-image: a sketch checkpoint with tiny random weights."""

from __future__ import annotations

import json
from pathlib import Path

from omnipipe.families.qwen_image.tiny import build_qwen_image
from omnipipe_sketch import MODEL_TYPE
from omnipipe_sketch.stages import PIPELINE_DIR


def build_sketch_image(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    build_qwen_image(target / PIPELINE_DIR)
    (target / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE}))
