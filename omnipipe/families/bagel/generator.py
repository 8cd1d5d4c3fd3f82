"""BAGEL's image generator: latent tokens (VAE latents in p x p patches) through the
generation expert, over a context's cache, predict the flow-matching velocity.

The query is BAGEL's: <|vision_start|>, the latent tokens, <|vision_end|>. The two
marker tokens are text and go through the understanding expert; each latent token is
vae2llm(patch) + time_embedder(t) + latent_pos_embed(row * max_latent_size + col).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from omnipipe.families.bagel.config import BagelConfig
from omnipipe.families.bagel.mot import ContextKV, LanguageModel

TIMESTEP_FREQUENCIES = 256
# Checkpoint weights the generator does not hold: vLLM's understanding side (ViT,
# connector, lm_head) and the VAE (FLUX's encoder./decoder. names, as vLLM skips them).
NOT_GENERATOR = (
    "vit_model.",
    "connector.",
    "vit_pos_embed.",
    "language_model.lm_head.",
    "encoder.",
    "decoder.",
)
WEIGHTS_FILE = "model.safetensors"


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """The fixed 2D sin-cos table BAGEL initialises latent_pos_embed with (MAE's)."""
    grid = np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32))

    def one_axis(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    # MAE's order: the column coordinate's half first (grid[0] varies along a row).
    table = np.concatenate([one_axis(dim // 2, grid[0]), one_axis(dim // 2, grid[1])], axis=1)
    return torch.from_numpy(table).float()


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQUENCIES, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIMESTEP_FREQUENCIES // 2
        steps = torch.arange(half, dtype=torch.float32, device=t.device)
        freqs = torch.exp(-math.log(10000) * steps / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        dtype = next(self.mlp.parameters()).dtype
        out: torch.Tensor = self.mlp(emb.to(dtype))
        return out


class LatentPositionEmbedding(nn.Module):
    def __init__(self, side: int, hidden: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_2d(hidden, side), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[ids]


class BagelGenerator(nn.Module):
    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        hidden = config.llm.hidden_size
        self.config = config
        self.language_model = LanguageModel(config.llm)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(config.patch_dim, hidden)
        self.llm2vae = nn.Linear(hidden, config.patch_dim)
        self.latent_pos_embed = LatentPositionEmbedding(config.max_latent_size, hidden)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32
    ) -> BagelGenerator:
        from safetensors.torch import load_file

        model = cls(BagelConfig.from_pretrained(path))
        weights = {}
        # Every *.safetensors at the top, as vLLM's loader reads them: tiny://bagel's
        # model.safetensors, the release's ema.safetensors (and ae.safetensors, the VAE).
        for file in sorted(Path(path).glob("*.safetensors")):
            for k, v in load_file(str(file)).items():
                if not k.startswith(NOT_GENERATOR):
                    weights[k] = v
        model.load_state_dict(weights, strict=True)
        return model.to(dtype).eval()

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Latent tokens per column and per row for an image of this size."""
        step = self.config.pixels_per_token
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}")
        rows, cols = height // step, width // step
        side = self.config.max_latent_size
        if rows > side or cols > side:
            raise ValueError(f"at most {side * step} pixels per side")
        return rows, cols

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        device = self.vae2llm.weight.device
        r = torch.arange(rows, device=device)[:, None]
        c = torch.arange(cols, device=device)[None, :]
        return (r * self.config.max_latent_size + c).flatten()

    def velocity(
        self,
        x_t: torch.Tensor,
        t: float,
        position_ids: torch.Tensor,
        context: ContextKV,
        markers: tuple[int, int],
    ) -> torch.Tensor:
        """The flow's velocity for latent tokens x_t (tokens, patch_dim) at time t."""
        lm = self.language_model.model
        weight = self.vae2llm.weight
        latent = (
            self.vae2llm(x_t.to(weight))
            + self.time_embedder(torch.tensor([t], device=weight.device))
            + self.latent_pos_embed(position_ids)
        )
        start, end = lm.embed_tokens(torch.tensor(list(markers), device=weight.device))
        x = torch.cat([start[None], latent, end[None]])
        gen = torch.zeros(x.shape[0], dtype=torch.bool, device=weight.device)
        gen[1:-1] = True
        hidden = lm.generate_hidden(x, gen, context)
        out: torch.Tensor = self.llm2vae(hidden[1:-1])
        return out
