"""A denoiser stage's acceleration: step caching by cache-dit's DBCache (Dual Block Cache).

Each denoising step, DBCache runs the transformer's first blocks and compares their
residual with the previous step's; where it changed less than the threshold (relative L1),
the remaining blocks are skipped and their cached residual reused. A threshold of 0 never
reuses a step, so the output is the uncached one exactly."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

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


class Acceleration(SpecModel):
    """How a denoiser stage trades exactness for speed; nothing is on unless set."""

    cache: StepCache | None = None
    """Step caching with cache-dit. Requests with a cache run as a group from their first
    step to their last (none joins between steps), with equal step counts."""
