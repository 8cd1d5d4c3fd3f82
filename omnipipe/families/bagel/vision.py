"""BAGEL's understanding-side image embedding, for the one-process reference: the SigLIP
ViT (transformers), the MLP connector and the ViT's 2D sin-cos position table, as vLLM's
BagelForConditionalGeneration computes them. The think stage itself uses vLLM's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnipipe.families.bagel.generator import sincos_2d

PREFIX = "vit_model.vision_model."


class BagelVision(nn.Module):
    def __init__(self, raw_config: dict[str, Any]) -> None:
        from transformers import SiglipVisionConfig, SiglipVisionModel

        super().__init__()
        vit = SiglipVisionConfig(**{**raw_config["vit_config"], "vision_use_head": False})
        hidden = int(raw_config["llm_config"]["hidden_size"])
        self.vit = SiglipVisionModel(vit)
        self.fc1 = nn.Linear(vit.hidden_size, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.side = int(raw_config.get("vit_max_num_patch_per_side", 70))
        raw_vit = raw_config["vit_config"]
        self.grid = int(raw_vit["image_size"]) // int(raw_vit["patch_size"])
        self.pos_embed = sincos_2d(hidden, self.side)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> BagelVision:
        from safetensors.torch import load_file

        root = Path(path)
        model = cls(json.loads((root / "config.json").read_text()))
        vit, connector = {}, {}
        for file in sorted(root.glob("*.safetensors")):
            for k, v in load_file(str(file)).items():
                if k.startswith(PREFIX):
                    vit[k.removeprefix(PREFIX)] = v
                elif k.startswith("connector."):
                    connector[k.removeprefix("connector.")] = v
        model.vit.load_state_dict(vit, strict=True)
        model.fc1.load_state_dict(
            {"weight": connector["fc1.weight"], "bias": connector["fc1.bias"]}
        )
        model.fc2.load_state_dict(
            {"weight": connector["fc2.weight"], "bias": connector["fc2.bias"]}
        )
        return model.eval()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(images, 3, H, W) -> (images, patches, hidden)."""
        features = self.vit(pixel_values=pixel_values).last_hidden_state
        embeds = self.fc2(nn.functional.gelu(self.fc1(features), approximate="tanh"))
        rows = torch.arange(self.grid)[:, None] * self.side + torch.arange(self.grid)[None, :]
        out: torch.Tensor = embeds + self.pos_embed[rows.flatten()].to(embeds.dtype)
        return out
