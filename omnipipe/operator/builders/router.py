"""The router's Deployment and Service."""

from __future__ import annotations

from omnipipe.api import constants as c
from omnipipe.api.names import router_labels, router_object_name, router_selector
from omnipipe.api.pipeline_traits import needs_store
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
    secret_env,
)
from omnipipe.operator.builders.context import BuildContext

API_KEY_ENV = "OMNIPIPE_ROUTER_API_KEY"
ADMIN_API_KEY_ENV = "OMNIPIPE_ROUTER_ADMIN_API_KEY"
ROUTER_DRAIN_SECONDS = 5


def router_config_hash(ctx: BuildContext) -> str:
    p = ctx.pipeline
    return content_hash(
        {
            "router": p.router.model_dump(mode="json"),
            "model": p.model,
            "pipeline": p.pipeline,
            "stages": [(s.name, s.role, s.inputs) for s in p.stages],
            **p.tracing.as_config(),
            **p.videos.as_config(),
            # Only a video or voice-cloning pipeline's router reads it: the others' hashes
            # stay as they were.
            **({"videoStore": ctx.video_store} if needs_store(p.pipeline) else {}),
        }
    )


def _env(ctx: BuildContext) -> list[Manifest]:
    env = [credential_env(ctx)]
    router = ctx.pipeline.router
    for name, ref in (
        (API_KEY_ENV, router.api_key_secret_ref),
        (ADMIN_API_KEY_ENV, router.admin_key_secret_ref),
    ):
        if ref is not None:
            env.append(secret_env(name, ref.name, ref.key))
    if needs_store(ctx.pipeline.pipeline):
        if (store := ctx.pipeline.videos.store_secret_ref) is not None:
            env.append(secret_env(c.VIDEO_STORE_ENV, store.name, store.key))
        elif ctx.video_store:
            env.append({"name": c.VIDEO_STORE_ENV, "value": ctx.video_store})
    return env


def build_router_deployment(ctx: BuildContext) -> Manifest:
    labels = router_labels(ctx.name)
    container: Manifest = {
        "name": "router",
        "image": ctx.router_image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["omnipipe"],
        "args": [*pipeline_file_args("router"), "--port", str(c.ROUTER_PORT)],
        "ports": [{"name": "http", "containerPort": c.ROUTER_PORT, "protocol": "TCP"}],
        "env": _env(ctx),
        # A crash's last log lines become its termination message, which the operator
        # reads into Stalled (reason CrashLooping) without any right to read logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": http_probe("/ready", "http", period=5, failures=3),
        "livenessProbe": http_probe("/health", "http", period=10, failures=6),
        # A terminating pod leaves the Service's endpoints while kube-proxy catches up:
        # it keeps answering for this long before uvicorn stops accepting connections,
        # so a request routed to it in that window is served, not refused (a rollout on
        # a real node refused one without it).
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_DRAIN_SECONDS}}},
        "securityContext": container_security_context(read_only_root=True),
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [config_mount(), {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(ctx, router_object_name(ctx.name), labels),
        "spec": {
            "replicas": ctx.pipeline.router.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": router_selector(ctx.name)},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {c.ANNOTATION_CONFIG_HASH: router_config_hash(ctx)},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [config_volume(ctx), {"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def build_router_service(ctx: BuildContext) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(ctx, router_object_name(ctx.name), router_labels(ctx.name)),
        "spec": {
            "type": ctx.pipeline.router.service_type.value,
            "selector": router_selector(ctx.name),
            "ports": [{"name": "http", "port": c.ROUTER_PORT, "targetPort": "http"}],
        },
    }


def router_endpoint(ctx: BuildContext) -> str:
    """The in-cluster OpenAI base URL of the pipeline."""
    return f"http://{router_object_name(ctx.name)}.{ctx.namespace}.svc:{c.ROUTER_PORT}/v1"
