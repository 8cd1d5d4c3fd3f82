"""A denoiser with acceleration.cache under `omnipipe serve`: the file's setting reaches
the worker, the openai client gets its image, and the worker's metrics count the
request-steps computed and reused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline

CACHE = (
    "  stages:\n    - name: denoise\n      acceleration:\n"
    "        cache: {threshold: 1, warmupSteps: 2, firstBlocks: 1}\n"
)


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    s = start_serve(write_pipeline(tmp_module, "cached", CACHE))
    yield s
    stop_cleanly(s)


def steps(served: Served, kind: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in served.metrics("denoise-0").splitlines()
        if line.startswith("omnipipe_stage_denoise_steps_total{") and f'kind="{kind}"' in line
    )


def test_the_step_cache_reuses_steps_and_the_worker_counts_them(served: Served) -> None:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        r = c.images.generate(
            model="cached",
            prompt="a lighthouse",
            size="64x64",
            extra_body={"num_inference_steps": 6, "seed": 1},
        )
    assert r.data[0].b64_json
    assert (steps(served, "computed"), steps(served, "reused")) == (2, 4)
