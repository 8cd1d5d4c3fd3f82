"""Weight quantization of tiny://qwen-image's DiT through torchao
(acceleration.quantization): every linear weight is quantized, and the latents stay near
the full-precision ones, each method within its own bound."""

from __future__ import annotations

import pytest
import torch

from omnipipe.stagekit.stage import StageJob
from tests.unit.denoisers import encoded, loaded, pipeline

BASE = {"width": 64, "height": 64, "num_inference_steps": 6, "guidance_scale": 4.0}
# Relative L2 error of the latents after 6 steps, measured at about a third of each
# bound on this model: int8 weights 0.3%, int8 weights and activations 0.5%, float8
# (e4m3, 3 mantissa bits) weights 2%.
BOUNDS = {"int8-weight-only": 0.01, "int8-dynamic": 0.015, "float8-weight-only": 0.06}


@pytest.fixture(scope="module")
def jobs() -> list[StageJob]:
    return encoded(
        [
            {**BASE, "prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 3},
            {**BASE, "prompt": "a cat", "seed": 4},
        ]
    )


@pytest.fixture(scope="module")
def full_precision(jobs: list[StageJob]) -> list[torch.Tensor]:
    stage = loaded(pipeline(None).stage("denoise"))
    return [r.tensors["latents"] for r in stage.run_batch(jobs)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", sorted(BOUNDS))
def test_quantized_latents_stay_near_full_precision(
    method: str, jobs: list[StageJob], full_precision: list[torch.Tensor]
) -> None:
    from torchao.utils import TorchAOBaseTensor

    stage = loaded(pipeline({"quantization": {"method": method}}).stage("denoise"))
    linears = [m for m in stage.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    assert all(isinstance(m.weight, TorchAOBaseTensor) for m in linears)
    got = [r.tensors["latents"] for r in stage.run_batch(jobs)]
    for full, quantized in zip(full_precision, got, strict=True):
        error = float((quantized - full).norm() / full.norm())
        assert 0 < error < BOUNDS[method], f"{method}: relative error {error:.4f}"


@pytest.mark.timeout(300)
def test_cfg_parallel_quantizes_its_second_copy_too(jobs: list[StageJob]) -> None:
    from torchao.utils import TorchAOBaseTensor

    accel = {"cfgParallelSize": 2, "quantization": {"method": "int8-weight-only"}}
    parallel = loaded(pipeline(accel).stage("denoise"))
    one_device = loaded(pipeline({"quantization": accel["quantization"]}).stage("denoise"))
    second = [m for m in parallel.branch.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m.weight, TorchAOBaseTensor) for m in second)
    got = [r.tensors["latents"] for r in parallel.run_batch(jobs)]
    expected = [r.tensors["latents"] for r in one_device.run_batch(jobs)]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
