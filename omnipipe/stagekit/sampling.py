"""Token sampling for the autoregressive stages, in the order transformers applies its
logits processors: repetition penalty, suppression, then temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from omnipipe.stagekit.stage import StageInputError

KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "repetition_penalty",
    "seed",
)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @classmethod
    def from_params(cls, defaults: Sampling, values: Any) -> Sampling:
        """defaults overridden by a request's values for this stage (already merged with
        the stage's spec by the router); a bad value is the client's error."""
        if values is None:
            return defaults
        if not isinstance(values, dict):
            raise StageInputError("sampling parameters must be an object")
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise StageInputError(f"unknown sampling parameters: {', '.join(unknown)}")
        merged = {k: getattr(defaults, k) for k in KEYS}
        merged.update({k: v for k, v in values.items() if v is not None})
        try:
            sampling = cls(
                temperature=float(merged["temperature"]),
                top_p=float(merged["top_p"]),
                top_k=int(merged["top_k"]),
                max_tokens=int(merged["max_tokens"]),
                min_tokens=int(merged["min_tokens"]),
                repetition_penalty=float(merged["repetition_penalty"]),
                seed=None if merged["seed"] is None else int(merged["seed"]),
            )
        except (TypeError, ValueError) as exc:
            raise StageInputError(f"invalid sampling parameter: {exc}") from None
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
            raise StageInputError("sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if sampling.max_tokens < 1 or sampling.repetition_penalty <= 0:
            raise StageInputError("sampling: need max_tokens >= 1 and repetition_penalty > 0")
        if not 0 <= sampling.min_tokens <= sampling.max_tokens:
            raise StageInputError("sampling: need 0 <= min_tokens <= max_tokens")
        return sampling

    def with_request_seed(self, params: dict[str, Any]) -> Sampling:
        """Seeded by the request's own seed where this sampling names none: the request's
        seed makes the whole chain reproducible, not just its first stage."""
        seed = params.get("seed")
        if self.seed is None and isinstance(seed, int):
            return dataclasses.replace(self, seed=seed)
        return self

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def next_token(
    logits: torch.Tensor,
    sampling: Sampling,
    seen: torch.Tensor,
    suppress: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> int:
    """logits: (vocab,) float; seen: ids the penalty applies to (prompt and output)."""
    scores = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and seen.numel():
        picked = scores.gather(0, seen)
        picked = torch.where(
            picked < 0, picked * sampling.repetition_penalty, picked / sampling.repetition_penalty
        )
        scores.scatter_(0, seen, picked)
    if suppress:
        scores[list(suppress)] = float("-inf")
    if sampling.temperature == 0:
        return int(scores.argmax())
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        cutoff = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < cutoff, float("-inf"))
    if sampling.top_p < 1.0:
        # transformers' TopPLogitsWarper, operation for operation: the rounding of the
        # cumulative sum decides a token at the edge, and the reference's codes with it.
        ordered, order = scores.sort(descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= (1 - sampling.top_p)
        drop[-1:] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
