"""cache-dit's DBCache on the Z-Image DiT whose steps the denoise stage drives itself.

cache-dit decides, step by step, whether the transformer's remaining main blocks can be
skipped by comparing the first blocks' residual with the previous forward's. That
comparison is only meaningful while every forward carries the same rows, so a cached
stage runs a group of requests from their first step to their last with none joining
(SteppedStage.joins_between_steps), and the cache context starts afresh whenever the
rows change: a new group, one whose request left early, or one whose request's CFG
stopped (cfg_truncation drops its negative rows). The blocks are cache-dit's own Z-Image
adapter's: the main `layers`, each taking the unified sequence and returning it alone
(Pattern_3); the refiners before them always run."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from omnipipe.api.acceleration import StepCache


class StepCacher:
    """One transformer's DBCache, and which of its forwards reused the cache."""

    def __init__(self, transformer: Any, settings: StepCache) -> None:
        import cache_dit
        from cache_dit import BlockAdapter, ForwardPattern

        blocks = transformer.layers
        # cache-dit asserts the first only inside each forward, and lets the first and
        # last blocks overlap (blocks run twice): both refused here, before any request.
        if not settings.first_blocks < len(blocks) >= settings.first_blocks + settings.last_blocks:
            raise ValueError(
                f"acceleration.cache: firstBlocks ({settings.first_blocks}) and lastBlocks "
                f"({settings.last_blocks}) need a transformer of more than "
                f"{settings.first_blocks} blocks and at least their sum; this one has "
                f"{len(blocks)}"
            )
        self._cache_dit = cache_dit
        self.transformer = transformer
        self.settings = settings
        cache_dit.enable_cache(
            BlockAdapter(
                transformer=transformer,
                blocks=blocks,
                forward_pattern=ForwardPattern.Pattern_3,
                # Z-Image's blocks name their input x, not hidden_states, as cache-dit's
                # own Z-Image adapter says.
                check_forward_pattern=False,
            ),
            cache_config=self._config(None),
        )
        self._group: Hashable = ()
        # cache-dit's own accounting is written out only when a context ends; a step is
        # seen as reused, as it happens, by the last block that a reused step skips not
        # running. With no block between the first and last ones computed, none is.
        skippable = len(blocks) - settings.last_blocks - 1
        self._witness_runs = 0
        self._runs_before = 0
        self._witnessed = skippable >= settings.first_blocks
        if self._witnessed:
            blocks[skippable].register_forward_pre_hook(self._count_witness_run)

    def _count_witness_run(self, module: Any, args: Any) -> None:
        self._witness_runs += 1

    def _config(self, steps: int | None) -> Any:
        from cache_dit import DBCacheConfig

        s = self.settings
        return DBCacheConfig(
            num_inference_steps=steps,
            residual_diff_threshold=s.threshold,
            max_warmup_steps=s.warmup_steps,
            Fn_compute_blocks=s.first_blocks,
            Bn_compute_blocks=s.last_blocks,
            max_cached_steps=-1 if s.max_cached_steps is None else s.max_cached_steps,
            max_continuous_cached_steps=(
                -1 if s.max_consecutive_cached_steps is None else s.max_consecutive_cached_steps
            ),
        )

    def start_step(self, rows: Hashable, steps_left: int) -> None:
        """Before a forward of `rows` (what tells one forward's rows from another's), with
        `steps_left` to go."""
        if rows != self._group:
            self._cache_dit.refresh_context(self.transformer, cache_config=self._config(steps_left))
            self._group = rows
        self._runs_before = self._witness_runs

    def reused_last_step(self) -> bool:
        """Whether the forward just run skipped the cached blocks."""
        return self._witnessed and self._witness_runs == self._runs_before
