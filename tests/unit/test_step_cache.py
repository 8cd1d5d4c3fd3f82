"""Step caching on the Qwen-Image denoiser (acceleration.cache, cache-dit's DBCache), on
tiny://qwen-image: a zero threshold is the uncached output exactly; a high one reuses
steps, and the stage counts each request-step computed or reused as cache-dit itself
accounts them; a cached group runs its steps together, none joining."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from omnipipe.api import ResolvedPipeline
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.worker.stage_classes import stage_class
from tests.unit import denoisers
from tests.unit.denoisers import encoded, loaded

STEPS = 8
BASE = {"width": 64, "height": 64, "num_inference_steps": STEPS, "guidance_scale": 4.0}


def pipeline(cache: dict[str, Any] | None) -> ResolvedPipeline:
    return denoisers.pipeline({"cache": cache} if cache is not None else None)


@pytest.fixture(scope="module")
def jobs() -> list[StageJob]:
    return encoded(
        [
            {**BASE, "prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 3},
            {**BASE, "prompt": "a cat", "seed": 4},
        ]
    )


def denoised(cache: dict[str, Any] | None, jobs: list[StageJob]) -> tuple[list[Any], Counter[str]]:
    stage = loaded(pipeline(cache).stage("denoise"))
    counted: Counter[str] = Counter()
    stage.count_steps = lambda kind, n: counted.update({kind: n})
    latents = [r.tensors["latents"] for r in stage.run_batch(jobs)]
    return latents, counted


@pytest.mark.timeout(300)
def test_a_zero_threshold_is_the_uncached_output_exactly(jobs: list[StageJob]) -> None:
    plain, plain_counts = denoised(None, jobs)
    cached, counts = denoised({"threshold": 0, "warmupSteps": 0, "firstBlocks": 1}, jobs)
    for a, b in zip(plain, cached, strict=True):
        assert torch.equal(a, b)
    assert counts == plain_counts == Counter(computed=STEPS * len(jobs))


@pytest.mark.timeout(300)
def test_a_high_threshold_reuses_steps_and_counts_them_as_cache_dit_does(
    jobs: list[StageJob],
) -> None:
    import cache_dit

    plain, _ = denoised(None, jobs)
    stage = loaded(pipeline({"threshold": 1, "warmupSteps": 2, "firstBlocks": 1}).stage("denoise"))
    counted: Counter[str] = Counter()
    stage.count_steps = lambda kind, n: counted.update({kind: n})
    cached = [r.tensors["latents"] for r in stage.run_batch(jobs)]
    [stats, *_] = cache_dit.summary(stage.pipe.transformer, logging=False)
    reused_steps = len(stats.cached_steps)
    # Past the two warm-up steps, a threshold of 1 reuses every step it may.
    assert reused_steps == STEPS - 2
    assert counted == Counter(computed=2 * len(jobs), reused=reused_steps * len(jobs))
    assert all(not torch.equal(a, b) for a, b in zip(plain, cached, strict=True))
    assert all(torch.isfinite(b).all() for b in cached)


@pytest.mark.timeout(300)
def test_max_cached_steps_bounds_the_reuse(jobs: list[StageJob]) -> None:
    cache = {"threshold": 1, "warmupSteps": 2, "firstBlocks": 1, "maxCachedSteps": 3}
    _, counts = denoised(cache, jobs[:1])
    assert counts == Counter(computed=STEPS - 3, reused=3)


def leave_after_three_steps(stage: Any, jobs: list[StageJob]) -> Any:
    """Two requests step together; after three steps one leaves (its client hung up) and
    the other goes on alone."""
    states = [stage.begin(j) for j in jobs]
    for _ in range(3):
        stage.step(states)
    while not stage.finished(states[0]):
        stage.step(states[:1])
    return stage.finish(states[0]).tensors["latents"]


@pytest.mark.timeout(300)
def test_a_group_that_loses_a_request_goes_on_in_a_fresh_cache_context(
    jobs: list[StageJob],
) -> None:
    plain = leave_after_three_steps(loaded(pipeline(None).stage("denoise")), jobs)
    exact = pipeline({"threshold": 0, "warmupSteps": 0, "firstBlocks": 1}).stage("denoise")
    assert torch.equal(leave_after_three_steps(loaded(exact), jobs), plain)
    # With reuse: two warm-up steps and one reused together; then, in a context of its
    # own, the one left warms up again (two steps) and reuses its last three.
    stage = loaded(pipeline({"threshold": 1, "warmupSteps": 2, "firstBlocks": 1}).stage("denoise"))
    counted: Counter[str] = Counter()
    stage.count_steps = lambda kind, n: counted.update({kind: n})
    assert torch.isfinite(leave_after_three_steps(stage, jobs)).all()
    assert counted == Counter(computed=2 * 2 + 2, reused=1 * 2 + 3)


def test_a_cached_group_runs_together_with_equal_step_counts(jobs: list[StageJob]) -> None:
    plain = pipeline(None).stage("denoise")
    cached = pipeline({"threshold": 0.1}).stage("denoise")
    path = resolve_model_path("tiny://qwen-image")
    uncached_stage = stage_class(plain, path)(plain, path, "cpu")
    cached_stage = stage_class(cached, path)(cached, path, "cpu")
    cached_stage.cacher = object()  # as load() sets it, without loading the model
    uncached_stage.cacher = None
    assert uncached_stage.joins_between_steps
    assert not cached_stage.joins_between_steps
    fewer = StageJob({**jobs[0].params, "num_inference_steps": 4}, jobs[0].inputs)
    assert uncached_stage.batch_key(fewer) == uncached_stage.batch_key(jobs[0])
    assert cached_stage.batch_key(fewer) != cached_stage.batch_key(jobs[0])


def test_a_stage_without_step_caching_refuses_the_setting() -> None:
    class Plain(Stage):
        def load(self) -> None: ...

        def run(self, job: StageJob) -> StageResult:
            return StageResult()

    spec = pipeline({"threshold": 0.1}).stage("denoise")
    with pytest.raises(NotImplementedError) as err:
        Plain(spec, "unused", "cpu")
    assert "stage denoise: Plain does not support acceleration.cache;" in str(err.value)


@pytest.mark.parametrize(
    ("blocks", "says"),
    [({"firstBlocks": 2}, "more than 2 blocks"), ({"firstBlocks": 1, "lastBlocks": 2}, "has 2")],
)
def test_block_counts_the_model_cannot_take_stop_the_stage_at_load(
    blocks: dict[str, int], says: str
) -> None:
    with pytest.raises(ValueError, match=r"acceleration\.cache: firstBlocks") as err:
        loaded(pipeline({"threshold": 0.1, **blocks}).stage("denoise"))
    assert says in str(err.value)
