"""CFG-parallel on tiny://qwen-image (acceleration.cfgParallelSize 2): the negative rows
run on a second copy of the DiT beside the positive ones, and the latents equal the one
batch of both branches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnipipe.families.qwen_image.cfg_parallel import branch_device
from omnipipe.stagekit.stage import StageJob
from tests.unit.denoisers import encoded, loaded, pipeline

BASE = {"width": 64, "height": 64, "num_inference_steps": 6, "guidance_scale": 4.0}


@pytest.fixture(scope="module")
def jobs() -> list[StageJob]:
    # Two CFG requests with negative prompts of other lengths and their own scales, and
    # one without CFG, so the two devices' batches differ from the one batch in rows and
    # in padding.
    return encoded(
        [
            {**BASE, "prompt": "a lighthouse at dusk over a calm sea", "negative_prompt": "blurry"},
            {**BASE, "prompt": "a cat", "seed": 4},
            {
                **BASE,
                "prompt": "a dog",
                "negative_prompt": "ugly, low quality, watermark",
                "guidance_scale": 2.5,
                "seed": 5,
            },
        ]
    )


def forwards_counted(stage: Any) -> list[int]:
    """The batch size of every forward of the stage's second DiT copy."""
    rows: list[int] = []
    stage.branch.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(len(kw["hidden_states"])), with_kwargs=True
    )
    return rows


@pytest.mark.timeout(300)
def test_cfg_parallel_equals_one_batch_of_both_branches(jobs: list[StageJob]) -> None:
    one_batch = loaded(pipeline(None).stage("denoise"))
    parallel = loaded(pipeline({"cfgParallelSize": 2}).stage("denoise"))
    assert one_batch.branch is None
    branch_rows = forwards_counted(parallel)
    expected = [r.tensors["latents"] for r in one_batch.run_batch(jobs)]
    got = [r.tensors["latents"] for r in parallel.run_batch(jobs)]
    # Only the two CFG requests' negative rows went to the second copy, every step.
    assert branch_rows == [2] * BASE["num_inference_steps"]
    for a, b in zip(expected, got, strict=True):
        # Float rounding of other batch shapes and padding, not a different computation.
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_batch_without_cfg_never_reaches_the_second_device(jobs: list[StageJob]) -> None:
    parallel = loaded(pipeline({"cfgParallelSize": 2}).stage("denoise"))
    branch_rows = forwards_counted(parallel)
    alone = loaded(pipeline(None).stage("denoise"))
    [got] = parallel.run_batch(jobs[1:2])
    [expected] = alone.run_batch(jobs[1:2])
    assert branch_rows == []
    assert torch.equal(got.tensors["latents"], expected.tensors["latents"])


def test_the_second_device_is_the_next_gpu_or_the_cpu_again() -> None:
    assert branch_device(torch.device("cpu")) == torch.device("cpu")
    if torch.cuda.device_count() >= 2:
        assert branch_device(torch.device("cuda", 0)) == torch.device("cuda", 1)
    else:
        with pytest.raises(ValueError, match="needs a second GPU after cuda:0"):
            branch_device(torch.device("cuda", 0))


@pytest.mark.timeout(300)
def test_sleep_level_1_finds_both_copies_of_the_dit() -> None:
    stage = loaded(pipeline({"cfgParallelSize": 2}).stage("denoise"))
    assert stage.branch is not None
    found = {id(m) for m in stage.torch_modules()}
    assert {id(stage.pipe.transformer), id(stage.branch.transformer)} <= found
