"""LoRA adapters on tiny://qwen-image's denoiser (spec.adapters), made locally with peft:
an adapter changes the image, scale 0 is the base model exactly, requests with different
adapters never share a batch and each gets its own result, and a request naming an
adapter the stage lacks is a client error."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.qwen_image.tiny_lora import save_tiny_lora
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.stagekit.vllm.lora import lora_engine_args
from tests.unit.denoisers import encoded, loaded, pipeline

BASE = {"width": 64, "height": 64, "num_inference_steps": 4, "guidance_scale": 4.0}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("loras")
    return [
        {"name": name, "source": str(save_tiny_lora(root / name, seed)), "stage": "denoise"}
        for name, seed in (("ink", 1), ("neon", 2))
    ]


@pytest.fixture(scope="module")
def stage(adapters: list[dict[str, Any]]) -> Any:
    return loaded(pipeline(None, adapters=adapters).stage("denoise"))


@pytest.fixture(scope="module")
def job() -> StageJob:
    [job] = encoded([{**BASE, "prompt": "a lighthouse", "negative_prompt": "blurry", "seed": 3}])
    return job


def run(stage: Any, job: StageJob, lora: dict[str, Any] | None) -> torch.Tensor:
    params = {**job.params, **({"lora": lora} if lora else {})}
    [result] = stage.run_batch([StageJob(params, job.inputs)])
    return result.tensors["latents"]


def test_an_adapter_changes_the_output_and_scale_zero_is_the_base(
    stage: Any, job: StageJob
) -> None:
    base = run(stage, job, None)
    ink = run(stage, job, {"name": "ink", "scale": 1.0})
    neon = run(stage, job, {"name": "neon", "scale": 1.0})
    assert not torch.allclose(ink, base, atol=1e-3)
    assert not torch.allclose(neon, ink, atol=1e-3)
    assert torch.equal(run(stage, job, {"name": "ink", "scale": 0.0}), base)
    # Switching back and forth leaves nothing behind: the same request, the same result.
    assert torch.equal(run(stage, job, {"name": "ink", "scale": 1.0}), ink)
    assert torch.equal(run(stage, job, None), base)


def test_requests_with_other_adapters_or_scales_never_share_a_batch(
    stage: Any, job: StageJob
) -> None:
    keys = {
        stage.batch_key(StageJob({**job.params, **extra}, job.inputs))
        for extra in (
            {},
            {"lora": {"name": "ink", "scale": 1.0}},
            {"lora": {"name": "ink", "scale": 0.5}},
            {"lora": {"name": "neon", "scale": 1.0}},
        )
    }
    assert len(keys) == 4


def test_the_base_model_without_adapters_is_the_one_with_them_off(job: StageJob) -> None:
    plain = loaded(pipeline(None).stage("denoise"))
    [expected] = plain.run_batch([job])
    assert plain.adapters.names == set()
    assert torch.equal(run(plain, job, None), expected.tensors["latents"])


@pytest.mark.parametrize(
    ("lora", "says"),
    [
        ({"name": "sketch", "scale": 1.0}, "lora.name: this stage has no adapter 'sketch'"),
        ({"name": "ink", "scale": 99}, "lora.scale: must be a number from 0 to 8"),
        ({"name": "ink", "scale": True}, "lora.scale"),
        ("ink", "lora: must be an object"),
    ],
)
def test_a_lora_the_stage_cannot_apply_is_a_client_error(
    stage: Any, job: StageJob, lora: Any, says: str
) -> None:
    with pytest.raises(StageInputError, match="lora") as err:
        stage.begin(StageJob({**job.params, "lora": lora}, job.inputs))
    assert says in err.value.message


def test_cfg_parallel_applies_the_adapter_on_both_copies(
    stage: Any, job: StageJob, adapters: list[dict[str, Any]]
) -> None:
    parallel = loaded(pipeline({"cfgParallelSize": 2}, adapters=adapters).stage("denoise"))
    lora = {"name": "neon", "scale": 0.7}
    torch.testing.assert_close(run(parallel, job, lora), run(stage, job, lora), rtol=0, atol=1e-5)


def test_the_step_cache_at_threshold_zero_keeps_the_adapters_image(
    stage: Any, job: StageJob, adapters: list[dict[str, Any]]
) -> None:
    exact = {"cache": {"threshold": 0, "warmupSteps": 0, "firstBlocks": 1}}
    cached = loaded(pipeline(exact, adapters=adapters).stage("denoise"))
    lora = {"name": "ink", "scale": 1.0}
    assert torch.equal(run(cached, job, lora), run(stage, job, lora))


@pytest.mark.parametrize(
    ("source", "refusal"),
    [
        # Qwen2.5-Omni's thinker adapter: a real PEFT adapter, of a language model.
        ("tiny://qwen2.5-omni-lora", "name no layer of this model's DiT"),
        ("rank-520", "LoRA rank 520; a stage loads ranks 1 to 512"),
    ],
)
def test_an_adapter_this_dit_cannot_use_is_refused_by_name_and_nothing_changes(
    stage: Any,
    adapters: list[dict[str, Any]],
    tmp_path: Any,
    job: StageJob,
    source: str,
    refusal: str,
) -> None:
    """diffusers loads an adapter whose weights name none of the DiT's layers with a
    warning, and it changes nothing: the stage refuses it by name instead, all or nothing."""
    if source == "rank-520":
        source = str(save_tiny_lora(tmp_path / "wide", seed=5, rank=520))
    before = run(stage, job, {"name": "ink", "scale": 1.0})
    foreign = Adapter(name="foreign", source=source, stage="denoise")
    with pytest.raises(ValueError, match="adapter foreign: ") as refused:
        stage.set_adapters([*(Adapter(**a) for a in adapters), foreign])
    assert refusal in str(refused.value)
    assert stage.adapters.names == {"ink", "neon"}
    assert torch.equal(run(stage, job, {"name": "ink", "scale": 1.0}), before)


@pytest.mark.parametrize("rank", [0, 513, 100_000])
def test_a_vllm_stage_sizes_no_engine_for_a_rank_past_the_bound(tmp_path: Any, rank: int) -> None:
    """vLLM sizes every slot's buffers by max_lora_rank, taken from the adapters' own
    adapter_config.json: a rank past vLLM's largest is refused before an engine starts."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": rank}))
    thinker = Adapter(name="wide", source=str(tmp_path), stage="thinker")
    with pytest.raises(ValueError, match=f"LoRA rank {rank}; a stage loads ranks 1 to 512"):
        lora_engine_args([thinker], {})
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 24}))
    assert lora_engine_args([thinker], {})["max_lora_rank"] == 32
