"""Invalid OmniPipelines, each with what the API server and `omnipipe` must say.

The same table drives tests/unit (pydantic validation: omnipipe serve/render) and
tests/integration (kubectl apply against the real API server and the generated CRD), so
the two validators cannot drift apart.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Manifest = dict[str, Any]


def base() -> Manifest:
    return {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "bad"},
        "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
    }


def custom(*stages: Manifest) -> Manifest:
    m = base()
    m["spec"]["pipeline"] = "custom"
    m["spec"]["stages"] = list(stages)
    return m


def _stage(name: str, inputs: list[str] | None = None) -> Manifest:
    s: Manifest = {"name": name, "role": "denoiser", "engine": "diffusers"}
    if inputs is not None:
        s["inputs"] = inputs
    return s


def with_spec(**fields: Any) -> Manifest:
    m = base()
    m["spec"].update(copy.deepcopy(fields))
    return m


def omni_with(**fields: Any) -> Manifest:
    m = with_spec(**fields)
    m["spec"].update({"model": "tiny://qwen2.5-omni", "pipeline": "qwen2.5-omni"})
    return m


def with_stage(**fields: Any) -> Manifest:
    return with_spec(stages=[{"name": "denoise", **fields}])


def without(key: str) -> Manifest:
    m = base()
    del m["spec"][key]
    return m


def renamed(name: str) -> Manifest:
    m = base()
    m["metadata"]["name"] = name
    return m


ADAPTER_STAGE = (
    "spec.adapters[].stage: LoRA adapters apply to a denoiser or a thinker stage of this pipeline"
)


@dataclass(frozen=True)
class Invalid:
    id: str
    make: Callable[[], Manifest]
    kube: str  # substring of kubectl's error: it names the field
    local: str  # substring of omnipipe's ManifestError


CASES = [
    Invalid(
        "unknown-engine",
        lambda: with_stage(engine="tensorrt"),
        'spec.stages[0].engine: Unsupported value: "tensorrt"',
        "stages.0.engine",
    ),
    Invalid(
        "dangling-input",
        lambda: custom(_stage("a"), _stage("b", ["zzz"])),
        "spec.stages: Invalid value",
        "'zzz' is not a stage",
    ),
    Invalid(
        "two-stage-cycle",
        lambda: custom(_stage("a", ["b"]), _stage("b", ["a"])),
        "may not have cycles",
        "may not have cycles",
    ),
    Invalid(
        "self-loop",
        lambda: custom(_stage("a", ["a"])),
        "may not have cycles",
        "may not have cycles",
    ),
    Invalid(
        "default-consumes-added-stage",
        lambda: with_spec(stages=[{"name": "encode", "inputs": ["extra"]}, _stage("extra")]),
        "may not have cycles",
        "may not have cycles",
    ),
    Invalid(
        "duplicate-names",
        lambda: with_spec(
            stages=[{"name": "denoise", "replicas": 2}, {"name": "denoise", "replicas": 3}]
        ),
        "spec.stages[1]: Duplicate value",
        "duplicate stage names: denoise",
    ),
    Invalid(
        "negative-gpus",
        lambda: with_stage(resources={"gpus": -1}),
        "spec.stages[0].resources.gpus: Invalid value: -1",
        "resources.gpus",
    ),
    Invalid(
        "min-above-max",
        lambda: with_stage(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
        "minReplicas must be <= maxReplicas",
        "minReplicas must be <= autoscaling.maxReplicas",
    ),
    Invalid(
        "missing-model",
        lambda: without("model"),
        "spec.model: Required value",
        "spec.model: Field required",
    ),
    Invalid(
        "missing-pipeline",
        lambda: without("pipeline"),
        "spec.pipeline: Required value",
        "spec.pipeline: Field required",
    ),
    Invalid(
        "unknown-pipeline",
        lambda: with_spec(pipeline="sdxl"),
        'spec.pipeline: Unsupported value: "sdxl"',
        "unknown pipeline type 'sdxl'",
    ),
    Invalid(
        "replicas-not-integer",
        lambda: with_stage(replicas="two"),
        "spec.stages[0].replicas: Invalid value",
        "stages.0.replicas",
    ),
    Invalid(
        "stages-not-a-list",
        lambda: with_spec(stages="denoise"),
        "spec.stages: Invalid value",
        "spec.stages",
    ),
    Invalid(
        "pipeline-name-too-long",
        lambda: renamed("p" * 60),
        "metadata.name must be a DNS label",
        "metadata.name",
    ),
    Invalid(
        "pipeline-name-not-dns-label",
        lambda: renamed("a.b"),
        "metadata.name must be a DNS label",
        "metadata.name",
    ),
    Invalid(
        "stage-name-not-dns-label",
        lambda: with_spec(stages=[_stage("Upscale_2")]),
        "spec.stages[0].name: Invalid value",
        "stages.0.name",
    ),
    Invalid(
        "child-name-too-long",
        lambda: {
            **renamed("p" * 50),
            "spec": {"model": "m", "pipeline": "custom", "stages": [_stage("s" * 20)]},
        },
        "<pipeline>-<stage> must be at most 63 characters",
        "longer than 63",
    ),
    Invalid(
        "added-stage-without-role",
        lambda: custom({"name": "a"}),
        "role and engine are required",
        "role and engine are required",
    ),
    Invalid(
        "custom-without-stages",
        lambda: custom(),
        "a custom pipeline must define at least one stage",
        "at least one stage",
    ),
    Invalid(
        "unknown-field",
        lambda: with_stage(gpu=1),
        'unknown field "spec.stages[0].gpu"',
        "stages.0.gpu: Extra inputs",
    ),
    Invalid(
        "negative-replicas",
        lambda: with_stage(replicas=-1),
        "spec.stages[0].replicas: Invalid value: -1",
        "stages.0.replicas",
    ),
    Invalid(
        "unknown-service-type",
        lambda: with_spec(router={"serviceType": "External"}),
        'spec.router.serviceType: Unsupported value: "External"',
        "router.serviceType",
    ),
    Invalid(
        "unknown-transfer-backend",
        lambda: with_spec(transfer={"backend": "rdma"}),
        'spec.transfer.backend: Unsupported value: "rdma"',
        "transfer.backend",
    ),
    Invalid(
        "promql-without-query",
        lambda: with_stage(autoscaling={"maxReplicas": 3, "metric": "promql"}),
        "query is required when metric is promql",
        "query is required",
    ),
    Invalid(
        "zero-target",
        lambda: with_stage(autoscaling={"maxReplicas": 3, "target": 0}),
        "spec.stages[0].autoscaling.target: Invalid value: 0",
        "autoscaling.target",
    ),
    Invalid(
        "autoscaling-without-max",
        lambda: with_stage(autoscaling={"minReplicas": 1}),
        "spec.stages[0].autoscaling.maxReplicas: Required value",
        "autoscaling.maxReplicas",
    ),
    Invalid(
        "bad-memory-quantity",
        lambda: with_stage(resources={"memory": "lots"}),
        "spec.stages[0].resources.memory: Invalid value",
        "resources.memory",
    ),
    Invalid(
        "too-many-stages",
        lambda: custom(*(_stage(f"s{i}") for i in range(17))),
        "spec.stages: Too many: 17: must have at most 16 items",
        "spec.stages",
    ),
    Invalid(
        "cache-without-size",
        lambda: with_spec(weights={"source": "cache"}),
        "size is required when source is cache",
        "weights.size is required when weights.source is cache",
    ),
    Invalid(
        "claim-path-without-claim",
        lambda: with_spec(weights={"path": "models/qwen"}),
        "path applies only to source claim or image",
        "weights.path applies only to weights.source claim or image",
    ),
    Invalid(
        "hub-token-in-the-spec",
        lambda: with_spec(weights={"source": "cache", "size": "1Gi", "token": "hf_abc"}),
        'unknown field "spec.weights.token"',
        "weights.token",
    ),
    Invalid(
        "step-cache-on-the-text-encoder",
        lambda: with_spec(stages=[{"name": "encode", "acceleration": {"cache": {}}}]),
        "acceleration (step caching, CFG-parallel, quantization) applies to a denoiser stage",
        "spec.stages[encode].acceleration: step caching, CFG-parallel and quantization apply "
        "to a denoiser stage, not a text-encoder",
    ),
    Invalid(
        "step-cache-on-a-custom-vae",
        lambda: custom(
            {
                "name": "decode",
                "role": "vae-decoder",
                "engine": "diffusers",
                "acceleration": {"cache": {"threshold": 0.1}},
            }
        ),
        "acceleration (step caching, CFG-parallel, quantization) applies to a denoiser stage",
        "spec.stages[decode].acceleration: step caching, CFG-parallel and quantization apply "
        "to a denoiser stage, not a vae-decoder",
    ),
    Invalid(
        "first-audio-scaling-of-a-denoiser",
        lambda: with_spec(
            stages=[
                {
                    "name": "denoise",
                    "autoscaling": {"maxReplicas": 2, "metric": "first-audio-p90"},
                }
            ]
        ),
        "autoscaling.metric first-audio-p90 is timed by a talker or code2wav stage",
        "spec.stages[denoise].autoscaling.metric: first-audio-p90 is timed by a talker or "
        "code2wav stage, not a denoiser",
    ),
    Invalid(
        "first-audio-scaling-of-a-custom-thinker",
        lambda: custom(
            {
                "name": "llm",
                "role": "thinker",
                "engine": "vllm",
                "autoscaling": {"maxReplicas": 2, "metric": "first-audio-p90"},
            }
        ),
        "autoscaling.metric first-audio-p90 is timed by a talker or code2wav stage",
        "spec.stages[llm].autoscaling.metric: first-audio-p90 is timed by a talker or "
        "code2wav stage, not a thinker",
    ),
    Invalid(
        "step-cache-negative-threshold",
        lambda: with_stage(acceleration={"cache": {"threshold": -0.1}}),
        "spec.stages[0].acceleration.cache.threshold: Invalid value: -0.1",
        "acceleration.cache.threshold",
    ),
    Invalid(
        "step-cache-unknown-method",
        lambda: with_stage(acceleration={"cache": {"method": "teacache"}}),
        "spec.stages[0].acceleration.cache.method: Unsupported value",
        "acceleration.cache.method",
    ),
    Invalid(
        "step-cache-no-first-blocks",
        lambda: with_stage(acceleration={"cache": {"firstBlocks": 0}}),
        "spec.stages[0].acceleration.cache.firstBlocks: Invalid value: 0",
        "acceleration.cache.firstBlocks",
    ),
    Invalid(
        "quantization-on-the-text-encoder",
        lambda: with_spec(
            stages=[{"name": "encode", "acceleration": {"quantization": {}}}],
        ),
        "acceleration (step caching, CFG-parallel, quantization) applies to a denoiser stage",
        "spec.stages[encode].acceleration: step caching, CFG-parallel and quantization apply",
    ),
    Invalid(
        "quantization-unknown-method",
        lambda: with_stage(acceleration={"quantization": {"method": "int4"}}),
        "spec.stages[0].acceleration.quantization.method: Unsupported value",
        "acceleration.quantization.method",
    ),
    Invalid(
        "cfg-parallel-over-three-devices",
        lambda: with_stage(acceleration={"cfgParallelSize": 3}),
        "spec.stages[0].acceleration.cfgParallelSize: Unsupported value: 3",
        "acceleration.cfgParallelSize",
    ),
    Invalid(
        "cfg-parallel-with-the-step-cache",
        lambda: with_stage(acceleration={"cfgParallelSize": 2, "cache": {}}),
        'spec.stages[0].acceleration.cfgParallelSize: Invalid value: "object": cache and '
        "cfgParallelSize 2 do not combine",
        "cache and cfgParallelSize 2 do not combine",
    ),
    Invalid(
        "cfg-parallel-on-one-gpu",
        lambda: with_stage(acceleration={"cfgParallelSize": 2}, resources={"gpus": 1}),
        'spec.stages[0].acceleration.cfgParallelSize: Invalid value: "object": '
        "acceleration.cfgParallelSize 2 needs two devices",
        "spec.stages[denoise].acceleration.cfgParallelSize: 2 needs two devices",
    ),
    Invalid(
        "adapter-on-the-text-encoder",
        lambda: with_spec(adapters=[{"name": "style", "source": "/lora", "stage": "encode"}]),
        ADAPTER_STAGE,
        "spec.adapters[style].stage: LoRA adapters apply to a denoiser or a thinker "
        "stage, not a text-encoder (encode)",
    ),
    Invalid(
        "adapter-on-a-stage-given-another-role",
        lambda: with_spec(
            stages=[{"name": "denoise", "role": "vae-decoder"}],
            adapters=[{"name": "style", "source": "/lora", "stage": "denoise"}],
        ),
        ADAPTER_STAGE,
        "LoRA adapters apply to a denoiser or a thinker stage, not a vae-decoder (denoise)",
    ),
    Invalid(
        "adapter-on-the-talker",
        lambda: omni_with(adapters=[{"name": "voice", "source": "/lora", "stage": "talker"}]),
        ADAPTER_STAGE,
        "spec.adapters[voice].stage: LoRA adapters apply to a denoiser or a thinker stage, "
        "not a talker (talker)",
    ),
    Invalid(
        "thinker-adapter-with-a-scale",
        lambda: omni_with(
            adapters=[{"name": "poet", "source": "/lora", "stage": "thinker", "scale": 0.5}]
        ),
        "spec.adapters[].scale: vLLM applies an adapter of a thinker whole",
        "spec.adapters[poet].scale: vLLM applies an adapter of a thinker whole",
    ),
    Invalid(
        "adapter-on-no-stage",
        lambda: with_spec(adapters=[{"name": "style", "source": "/lora", "stage": "refine"}]),
        ADAPTER_STAGE,
        "spec.adapters[style].stage: 'refine' is not a stage of this pipeline",
    ),
    Invalid(
        "adapter-named-as-the-pipeline",
        lambda: with_spec(adapters=[{"name": "bad", "source": "/lora", "stage": "denoise"}]),
        "spec.adapters[].name: the pipeline's own name is its base model's id",
        "spec.adapters[bad].name: the pipeline's own name is its base model's id",
    ),
    Invalid(
        "adapter-twice",
        lambda: with_spec(
            adapters=[
                {"name": "style", "source": "/a", "stage": "denoise"},
                {"name": "style", "source": "/b", "stage": "denoise"},
            ]
        ),
        'spec.adapters[1]: Duplicate value: {"name":"style"}',
        "spec.adapters: duplicate names: style",
    ),
    Invalid(
        "adapter-scale-too-high",
        lambda: with_spec(
            adapters=[{"name": "style", "source": "/a", "stage": "denoise", "scale": 9}]
        ),
        "spec.adapters[0].scale: Invalid value: 9",
        "adapters.0.scale",
    ),
    Invalid(
        "placement-groups-without-colocated",
        lambda: with_spec(
            placement={"groups": [{"name": "pair", "stages": ["denoise", "decode"]}]}
        ),
        "spec.placement.groups: Invalid value",
        "spec.placement.groups: groups need mode colocated",
    ),
    Invalid(
        "placement-unknown-stage",
        lambda: with_spec(
            placement={
                "mode": "colocated",
                "groups": [{"name": "pair", "stages": ["denoise", "decod"]}],
            }
        ),
        "every stage of a group must be a stage of this pipeline",
        "spec.placement.groups[pair].stages: 'decod' is not a stage of this pipeline",
    ),
    Invalid(
        "placement-stage-in-two-groups",
        lambda: with_spec(
            placement={
                "mode": "colocated",
                "groups": [
                    {"name": "front", "stages": ["encode", "denoise"]},
                    {"name": "back", "stages": ["denoise", "decode"]},
                ],
            }
        ),
        "it may be in one group only",
        "spec.placement.groups: denoise is in groups front and back; a stage runs in one process",
    ),
    Invalid(
        "placement-group-named-as-a-stage",
        lambda: with_spec(
            placement={
                "mode": "colocated",
                "groups": [{"name": "decode", "stages": ["denoise", "decode"]}],
            }
        ),
        "a group needs a name of its own",
        "spec.placement.groups[decode].name: decode is a stage name",
    ),
    Invalid(
        "placement-member-sets-replicas",
        lambda: with_spec(
            stages=[{"name": "decode", "replicas": 2}],
            placement={"mode": "colocated"},
        ),
        "a stage in a colocated group scales with it",
        "spec.stages[decode].replicas: decode runs in group all; a group scales as one: set "
        "replicas on spec.placement.groups: [{name: all, replicas: N}]",
    ),
    Invalid(
        "placement-two-vllm-stages",
        lambda: omni_with(
            stages=[{"name": "talker", "engine": "vllm"}], placement={"mode": "colocated"}
        ),
        "a group's process holds one vLLM engine",
        "spec.placement.groups[all]: thinker and talker both run on vLLM; a process holds one "
        "vLLM engine",
    ),
    Invalid(
        "placement-group-twice",
        lambda: with_spec(
            placement={
                "mode": "colocated",
                "groups": [
                    {"name": "g", "stages": ["encode", "denoise"]},
                    {"name": "g", "stages": ["decode", "denoise"]},
                ],
            }
        ),
        'spec.placement.groups[1]: Duplicate value: {"name":"g"}',
        "spec.placement.groups: duplicate group names: g",
    ),
    Invalid(
        "placement-one-stage-group",
        lambda: with_spec(
            placement={"mode": "colocated", "groups": [{"name": "alone", "stages": ["decode"]}]}
        ),
        "should have at least 2 items",
        "placement.groups.0.stages",
    ),
]
