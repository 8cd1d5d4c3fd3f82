from __future__ import annotations

from typing import Any

from omnipipe.api import parse_resource, resolve
from omnipipe.api.spec import Engine, Role


def pipeline(spec: dict[str, Any], name: str = "p") -> Any:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": spec,
            }
        )
    )


def test_known_pipeline_resolves_default_stages_in_order() -> None:
    p = pipeline({"model": "Qwen/Qwen-Image", "pipeline": "qwen-image"})
    assert [s.name for s in p.stages] == ["encode", "denoise", "decode"]
    assert [s.inputs for s in p.stages] == [(), ("encode",), ("denoise",)]
    assert p.stage("denoise").role is Role.DENOISER
    assert p.outputs == ("decode",)
    assert all(s.gpus == 1 for s in p.stages)


def test_override_changes_only_the_fields_it_sets() -> None:
    base = pipeline({"model": "Qwen/Qwen-Image", "pipeline": "qwen-image"})
    p = pipeline(
        {
            "model": "Qwen/Qwen-Image",
            "pipeline": "qwen-image",
            "stages": [{"name": "denoise", "replicas": 3, "engineArgs": {"steps": 4}}],
        }
    )
    assert p.stage("denoise").replicas == 3
    assert p.stage("denoise").engine_args == {"steps": 4}
    assert p.stage("denoise").engine is Engine.DIFFUSERS
    assert p.stage("encode") == base.stage("encode")
    assert p.stage("decode") == base.stage("decode")


def test_tiny_models_run_on_cpu_with_the_same_vllm_thinker() -> None:
    """The production engine is the tested one: tiny models change the device, not it."""
    tiny = pipeline({"model": "tiny://qwen2.5-omni", "pipeline": "qwen2.5-omni"})
    real = pipeline({"model": "Qwen/Qwen2.5-Omni-7B", "pipeline": "qwen2.5-omni"})
    assert tiny.stage("thinker").engine is Engine.VLLM
    assert real.stage("thinker").engine is Engine.VLLM
    assert all(s.gpus == 0 for s in tiny.stages)


def test_autoscaled_stage_starts_at_min_and_gets_metric_default_target() -> None:
    p = pipeline(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "stages": [{"name": "denoise", "autoscaling": {"minReplicas": 2, "maxReplicas": 6}}],
        }
    )
    stage = p.stage("denoise")
    assert stage.autoscaled
    assert stage.replicas == 2
    assert stage.target == 4.0


def test_added_stage_comes_after_defaults_and_custom_keeps_list_order() -> None:
    p = pipeline(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "stages": [
                {
                    "name": "upscale",
                    "role": "vae-decoder",
                    "engine": "diffusers",
                    "inputs": ["decode"],
                }
            ],
        }
    )
    assert [s.name for s in p.stages] == ["encode", "denoise", "decode", "upscale"]
    c = pipeline(
        {
            "model": "m",
            "pipeline": "custom",
            "stages": [
                {"name": "b", "role": "thinker", "engine": "vllm"},
                {
                    "name": "a",
                    "role": "talker",
                    "engine": "transformers",
                    "inputs": ["b"],
                    "model": "x",
                },
            ],
        }
    )
    assert [s.name for s in c.stages] == ["b", "a"]
    assert c.stage("a").model == "x"
    assert c.stage("b").model == "m"
