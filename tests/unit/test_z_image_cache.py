"""Step caching on the Z-Image denoiser (acceleration.cache, cache-dit's DBCache over the
DiT's main blocks), on tiny://z-image: a zero threshold is the uncached output exactly,
for a group whose rows change when one request's CFG stops (cfg_truncation); a high one
reuses steps, counted as cache-dit itself accounts them; a cached group runs together with
equal step counts, none joining; block counts the DiT cannot take stop the stage at load."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from omnipipe.stagekit.stage import StageJob
from tests.unit.test_z_image import BASE, encoded, loaded

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny://z-image"
STEPS = 6
REQUESTS = [
    {**BASE, "num_inference_steps": STEPS, "prompt": "a lighthouse at dusk", "seed": 1,
     "guidance_scale": 4.0, "negative_prompt": "blurry", "cfg_truncation": 0.1},
    {**BASE, "num_inference_steps": STEPS, "prompt": "a cat", "seed": 2, "guidance_scale": 0.0},
]  # fmt: skip


@pytest.fixture(scope="module")
def jobs() -> list[StageJob]:
    encode = loaded(MODEL, "encode")
    return [StageJob(p, encoded(encode, p)) for p in REQUESTS]


def cached_stage(cache: dict[str, Any] | None) -> tuple[Any, Counter[str]]:
    stages = [{"name": "denoise", "acceleration": {"cache": cache}}] if cache is not None else []
    stage = loaded(MODEL, "denoise", stages=stages)
    counted: Counter[str] = Counter()
    stage.count_steps = lambda kind, n: counted.update({kind: n})
    return stage, counted


def test_a_zero_threshold_is_the_uncached_output_exactly(jobs: list[StageJob]) -> None:
    plain, plain_counts = cached_stage(None)
    exact, counts = cached_stage({"threshold": 0, "warmupSteps": 0, "firstBlocks": 1})
    for a, b in zip(plain.run_batch(jobs), exact.run_batch(jobs), strict=True):
        assert torch.equal(a.tensors["latents"], b.tensors["latents"])
    assert counts == plain_counts == Counter(computed=STEPS * len(jobs))


def test_a_high_threshold_reuses_steps_and_counts_them_as_cache_dit_does(
    jobs: list[StageJob],
) -> None:
    import cache_dit

    # Rows that stay the same for all steps: one cache context, as cache-dit counts it.
    steady = [StageJob({**j.params, "cfg_truncation": 1.0}, j.inputs) for j in jobs]
    plain, _ = cached_stage(None)
    stage, counted = cached_stage({"threshold": 1, "warmupSteps": 2, "firstBlocks": 1})
    cached = [r.tensors["latents"] for r in stage.run_batch(steady)]
    [stats, *_] = cache_dit.summary(stage.pipe.transformer, logging=False)
    # Past the two warm-up steps, a threshold of 1 reuses every step it may.
    assert len(stats.cached_steps) == STEPS - 2
    assert counted == Counter(computed=2 * len(jobs), reused=(STEPS - 2) * len(jobs))
    for a, b in zip(plain.run_batch(steady), cached, strict=True):
        assert not torch.equal(a.tensors["latents"], b)
        assert torch.isfinite(b).all()


def test_a_cached_group_runs_together_with_equal_step_counts(jobs: list[StageJob]) -> None:
    plain, _ = cached_stage(None)
    cached, _ = cached_stage({"threshold": 0.1, "firstBlocks": 1})
    assert plain.joins_between_steps
    assert not cached.joins_between_steps
    fewer = StageJob({**jobs[0].params, "num_inference_steps": 4}, jobs[0].inputs)
    assert plain.batch_key(fewer) == plain.batch_key(jobs[0])
    assert cached.batch_key(fewer) != cached.batch_key(jobs[0])


def test_block_counts_the_dit_cannot_take_stop_the_stage_at_load() -> None:
    with pytest.raises(ValueError, match=r"acceleration\.cache: firstBlocks \(2\)") as err:
        cached_stage({"threshold": 0.1, "firstBlocks": 2})
    assert "this one has 2" in str(err.value)


def test_rows_that_change_go_on_in_a_fresh_cache_context(jobs: list[StageJob]) -> None:
    """The first request's CFG stops after three of its six steps (cfg_truncation 0.1 at
    tiny://z-image's shift): its negative rows leave the forward, and the group goes on in
    a fresh context, warming up again. Two warm-up steps and one reused before, the same
    after, for each request."""
    stage, counted = cached_stage({"threshold": 1, "warmupSteps": 2, "firstBlocks": 1})
    states = [stage.begin(j) for j in jobs]
    cfg_steps = []
    while not stage.finished(states[0]):
        cfg_steps.append(states[0].guidance_now() > 0)
        stage.step(states)
    assert cfg_steps == [True] * 3 + [False] * 3
    assert counted == Counter(computed=4 * len(jobs), reused=2 * len(jobs))
    assert all(torch.isfinite(stage.finish(s).tensors["latents"]).all() for s in states)
