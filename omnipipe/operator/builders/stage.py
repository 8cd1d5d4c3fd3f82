"""A stage's Deployment and headless Service."""

from __future__ import annotations

from typing import Any

from omnipipe.api import ResolvedStage
from omnipipe.api import constants as c
from omnipipe.api.names import (
    stage_deployment_name,
    stage_labels,
    stage_object_name,
    stage_revision_selector,
    stage_selector,
)
from omnipipe.api.placement import workload_of
from omnipipe.api.spec import Engine
from omnipipe.operator.builders.common import (
    Manifest,
    config_mount,
    config_volume,
    container_security_context,
    content_hash,
    credential_env,
    http_probe,
    object_meta,
    pipeline_file_args,
    pod_security_context,
)
from omnipipe.operator.builders.context import BuildContext
from omnipipe.operator.builders.weights import stage_weights

GPU_RESOURCE = "nvidia.com/gpu"
CACHE_DIR = "/var/cache/omnipipe"
# vLLM compiles kernels and writes caches next to its package at run time.
WRITABLE_ROOT_ENGINES = frozenset({Engine.VLLM})
# preStop: POST /drain with the pipeline's credential from the pod's environment. An
# httpGet hook can neither POST nor read a Secret into a header, so the hook is a
# stdlib-only Python one-liner (no shell: the command is a list). Loopback, not the pod
# IP: no NetworkPolicy applies to it, and the worker in a pod binds every address.
DRAIN_SCRIPT = (
    "import os, urllib.request as r; "
    f"r.urlopen(r.Request('http://127.0.0.1:{c.WORKER_CONTROL_PORT}/drain', method='POST', "
    f"headers={{'{c.CREDENTIAL_HEADER}': os.environ.get('{c.CREDENTIAL_ENV}', '')}}))"
)


def _resources(stage: ResolvedStage) -> Manifest:
    amounts: dict[str, Any] = {}
    if stage.cpu is not None:
        amounts["cpu"] = stage.cpu
    if stage.memory is not None:
        amounts["memory"] = stage.memory
    if stage.gpus:
        amounts[GPU_RESOURCE] = stage.gpus
    if not amounts:
        return {}
    # Requests equal limits: model servers should not be squeezed by noisy neighbours.
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(ctx: BuildContext, stage: ResolvedStage) -> list[Manifest]:
    env: list[Manifest] = [
        {"name": "OMNIPIPE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "OMNIPIPE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "OMNIPIPE_CACHE_DIR", "value": CACHE_DIR},
        credential_env(ctx),
        *stage_weights(ctx, stage).env,
    ]
    for var in stage.env:
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


def stage_config_hash(ctx: BuildContext, stage: ResolvedStage) -> str:
    """Only what this stage's pods read: editing another stage never rolls this one.
    Nor does a change of its LoRA adapters: its running workers load them from the
    ConfigMap as the kubelet updates it (but a thinker's first adapter, or its last gone,
    rolls it: ResolvedStage.restart_fields)."""
    dumped = stage.model_dump(mode="json", exclude={"adapters"})
    if stage.restart_fields().get("loraEngine"):
        dumped["loraEngine"] = True
    return content_hash(
        {
            "stage": dumped,
            "transfer": ctx.pipeline.transfer.model_dump(mode="json"),
            **ctx.pipeline.tracing.as_config(),
        }
    )


def _container(ctx: BuildContext, stage: ResolvedStage) -> Manifest:
    container: Manifest = {
        "name": "worker",
        "image": ctx.worker_image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["omnipipe"],
        "args": [*pipeline_file_args("worker"), "--stage", stage.name],
        "ports": [
            {"name": "control", "containerPort": c.WORKER_CONTROL_PORT, "protocol": "TCP"},
            {"name": "transfer", "containerPort": c.WORKER_TRANSFER_PORT, "protocol": "TCP"},
        ],
        "env": _env(ctx, stage),
        # A crash's last log lines become its termination message, which the operator
        # reads into Stalled (reason CrashLooping) without any right to read logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": http_probe("/ready", "control", period=5, failures=3),
        "livenessProbe": http_probe("/health", "control", period=10, failures=6),
        # POST /drain makes the worker fail /ready and returns once in-flight work is
        # done; terminationGracePeriodSeconds bounds it.
        "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", DRAIN_SCRIPT]}}},
        "securityContext": container_security_context(
            read_only_root=stage.engine not in WRITABLE_ROOT_ENGINES
        ),
        "volumeMounts": [
            config_mount(),
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
            *stage_weights(ctx, stage).mounts,
        ],
    }
    resources = _resources(stage)
    if resources:
        container["resources"] = resources
    return container


def pod_spec(ctx: BuildContext, stage: ResolvedStage) -> Manifest:
    spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": ctx.termination_grace_seconds,
        "containers": [_container(ctx, stage)],
        "volumes": [
            config_volume(ctx),
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            # UCX's shared-memory transports and NCCL need more than the runtime's 64 MiB.
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            *stage_weights(ctx, stage).volumes,
        ],
    }
    if stage.node_selector:
        spec["nodeSelector"] = dict(stage.node_selector)
    if stage.tolerations:
        spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in stage.tolerations
        ]
    return spec


def worker_deployment(
    ctx: BuildContext,
    worker: str,
    pod: Manifest,
    template_annotations: dict[str, str],
    replicas: int | None,
) -> Manifest:
    """One revision's Deployment of a worker: a stage's, or a colocated group's (named
    and labelled for the group). replicas None: an autoscaler owns the count."""
    labels = stage_labels(ctx.name, worker, ctx.revision)
    spec: Manifest = {
        "selector": {"matchLabels": stage_revision_selector(ctx.name, worker, ctx.revision)},
        "revisionHistoryLimit": 3,
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "template": {
            "metadata": {"labels": labels, "annotations": template_annotations},
            "spec": pod,
        },
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(ctx, stage_deployment_name(ctx.name, worker, ctx.revision), labels),
        "spec": spec,
    }


def build_stage_deployment(ctx: BuildContext, stage: ResolvedStage) -> Manifest:
    return worker_deployment(
        ctx,
        stage.name,
        pod_spec(ctx, stage),
        {c.ANNOTATION_CONFIG_HASH: stage_config_hash(ctx, stage)},
        # An autoscaled stage's replica count belongs to the autoscaler alone.
        None if stage.autoscaled else stage.replicas,
    )


def build_stage_service(ctx: BuildContext, stage: ResolvedStage) -> Manifest:
    """Headless: resolves to the stage's ready pods, which the router and upstream
    stages address one by one. A stage of a colocated group resolves to the group's
    pods, its transfer port to its own listener there (builders/group.py)."""
    workload = workload_of(ctx.pipeline, stage.name)
    index = workload.stages.index(stage.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            ctx, stage_object_name(ctx.name, stage.name), stage_labels(ctx.name, stage.name)
        ),
        "spec": {
            "clusterIP": "None",
            "selector": stage_selector(ctx.name, workload.name),
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": "control", "port": c.WORKER_CONTROL_PORT, "targetPort": "control"},
                {
                    "name": "transfer",
                    "port": c.WORKER_TRANSFER_PORT,
                    "targetPort": "transfer" if index == 0 else f"transfer-{index}",
                },
            ],
        },
    }
