"""A denoiser stage's acceleration: step caching, CFG-parallel and weight quantization.

Step caching is cache-dit's DBCache (Dual Block Cache): each denoising step runs the
transformer's first blocks and compares their residual with the previous step's; where it
changed less than the threshold (relative L1), the remaining blocks are skipped and their
cached residual reused. A threshold of 0 never reuses a step, so the output is the
uncached one exactly.

CFG-parallel runs a request's negative branch on a second device beside the positive one,
instead of both as one batch of two on one device. Quantization stores the DiT's linear
weights in 8 bits through torchao."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from omnipipe.api.spec_base import SpecModel

MAX_BLOCKS = 128
MAX_STEPS = 1000


class StepCache(SpecModel):
    """Reuse of a DiT's block outputs between denoising steps (cache-dit's DBCache)."""

    method: Literal["dbcache"] = "dbcache"
    """The caching method; cache-dit's DBCache is the one supported."""
    threshold: Annotated[float, Field(ge=0, le=1)] = 0.08
    """Relative L1 change of the first blocks' residual below which a step reuses the
    cache; 0 never reuses one. Higher is faster and further from the uncached image."""
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 8
    """Steps computed in full before any is reused: the early steps set the layout."""
    first_blocks: Annotated[int, Field(ge=1, le=MAX_BLOCKS)] = 8
    """Transformer blocks always computed at the start of a step (DBCache's Fn); their
    residual is what decides whether the step is reused. Fewer than the model has (60 in
    Qwen-Image; 2 in tiny://qwen-image), and with lastBlocks at most as many."""
    last_blocks: Annotated[int, Field(ge=0, le=MAX_BLOCKS)] = 0
    """Transformer blocks always computed at the end of a step (DBCache's Bn)."""
    max_cached_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] | None = None
    """Most steps that may be reused in one cache context: a group of requests from its
    first step, or from when one of them left; unset is no limit."""
    max_consecutive_cached_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
    """Most reused steps in a row before one is computed in full; unset is no limit."""


QuantizationMethod = Literal["int8-weight-only", "int8-dynamic", "float8-weight-only"]


class Quantization(SpecModel):
    """The DiT's linear layers in 8 bits (torchao), applied as the stage loads."""

    method: QuantizationMethod = "int8-weight-only"
    """int8-weight-only: int8 weights, computed in the model's dtype (half the memory of
    bf16, the CPU's and the GPU's); int8-dynamic: int8 weights and activations quantized
    per token as they come (int8 matmuls); float8-weight-only: float8 (e4m3) weights."""


class Acceleration(SpecModel):
    """How a denoiser stage trades exactness for speed; nothing is on unless set."""

    cache: StepCache | None = None
    """Step caching with cache-dit. Requests with a cache run as a group from their first
    step to their last (none joins between steps), with equal step counts."""
    cfg_parallel_size: Literal[1, 2] = 1
    """Devices a request's classifier-free guidance branches run on. 1: the positive and
    negative branches run as one batch of two on one device. 2: the negative branch runs
    on a second device (a second GPU of the pod: resources.gpus 2 or more; a second copy
    of the DiT on the CPU) at the same time, and its noise prediction comes back each step.
    Not with cache."""
    quantization: Quantization | None = None
    """Weight quantization of the DiT; unset keeps the checkpoint's precision."""

    @property
    def sets_anything(self) -> bool:
        return bool(self.cache or self.cfg_parallel_size > 1 or self.quantization)

    @model_validator(mode="after")
    def _cache_is_one_device(self) -> Self:
        if self.cache is not None and self.cfg_parallel_size > 1:
            raise ValueError(
                "cache and cfgParallelSize 2 do not combine: each branch's device would "
                "decide its own steps to reuse; use one of them"
            )
        return self
