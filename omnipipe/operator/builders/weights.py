"""Model weights (spec.weights): the claims the operator fills, their fetch Jobs, and
what a stage pod mounts.

With source cache, each distinct model of the pipeline gets one claim and one Job that
runs `omnipipe fetch MODEL /weights/model` into it. The fetch renames a complete download
into place, so the claim never holds a half-written model under that name, and the Job
succeeds only then: a stage whose claim's Job has not succeeded gets no Deployment yet
(build_children), so no pod starts without its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnipipe.api import ResolvedStage
from omnipipe.api import constants as c
from omnipipe.api.names import common_labels, fetch_job_name, weights_claim_name
from omnipipe.api.weights import CACHE_MODEL_DIR, WEIGHTS_DIR, WeightsSource
from omnipipe.operator.builders.common import (
    Manifest,
    container_security_context,
    content_hash,
    object_meta,
    pod_security_context,
    secret_env,
)
from omnipipe.operator.builders.context import BuildContext

# Where the fetch Job mounts the claim read-write.
FETCH_MOUNT = "/weights"
MODEL_PATH_ENV = "OMNIPIPE_WORKER_MODEL_PATH"
HF_TOKEN_ENV = "HF_TOKEN"
TERMINATION_LOG = "/dev/termination-log"
DEFAULT_ACCESS_MODES = ("ReadWriteOnce",)


@dataclass(frozen=True)
class StageWeights:
    """What a stage pod adds for its weights."""

    volumes: tuple[Manifest, ...] = ()
    mounts: tuple[Manifest, ...] = ()
    env: tuple[Manifest, ...] = ()


def cache_key(ctx: BuildContext, model: str) -> str:
    """One claim per pipeline, model and everything the claim is made of: a changed
    size, class, access mode or Hub revision is a new claim filled beside the old one
    (a claim's spec cannot be edited in place)."""
    w = ctx.weights
    return content_hash(
        {
            "pipeline": ctx.name,
            "model": model,
            "revision": w.revision,
            "size": str(w.size),
            "class": w.storage_class_name,
            "modes": list(w.access_modes or DEFAULT_ACCESS_MODES),
        }
    )[:10]


def cached_models(ctx: BuildContext) -> tuple[str, ...]:
    """The models the operator keeps a claim of, in stage order; none unless source cache."""
    if ctx.weights.source is not WeightsSource.CACHE:
        return ()
    return tuple(dict.fromkeys(s.model for s in ctx.pipeline.stages))


def fetch_job_for(ctx: BuildContext, model: str) -> str:
    return fetch_job_name(ctx.name, cache_key(ctx, model))


def waits_for_weights(ctx: BuildContext, stage: ResolvedStage) -> bool:
    """True while the stage's claim is not filled yet: its pods must not start."""
    if ctx.weights.source is not WeightsSource.CACHE:
        return False
    return fetch_job_for(ctx, stage.model) not in ctx.fetched


def _labels(ctx: BuildContext, key: str) -> dict[str, str]:
    return {**common_labels(ctx.name, c.COMPONENT_WEIGHTS), c.LABEL_MODEL_CACHE: key}


def _token_env(ctx: BuildContext) -> list[Manifest]:
    ref = ctx.weights.hub_token_secret_ref
    if ref is None:
        return []
    return [secret_env(HF_TOKEN_ENV, ref.name, ref.key)]


def build_weights_claim(ctx: BuildContext, model: str) -> Manifest:
    key = cache_key(ctx, model)
    spec: Manifest = {
        "accessModes": list(ctx.weights.access_modes or DEFAULT_ACCESS_MODES),
        "resources": {"requests": {"storage": str(ctx.weights.size)}},
    }
    if ctx.weights.storage_class_name is not None:
        spec["storageClassName"] = ctx.weights.storage_class_name
    meta = object_meta(ctx, weights_claim_name(ctx.name, key), _labels(ctx, key))
    meta["annotations"] = {"omnipipe.io/model": model}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def build_fetch_job(ctx: BuildContext, model: str) -> Manifest:
    """`omnipipe fetch` into the claim. Failed attempts are retried by the Job controller
    with its exponential back-off (10 s, 20 s, ... up to 6 min); each attempt resumes the
    staged download. The fetch writes its reason (NoSpace, NoAccess, ...) as the
    termination message, which the operator puts into the ModelCached condition."""
    key = cache_key(ctx, model)
    labels = _labels(ctx, key)
    args = ["fetch", model, f"{FETCH_MOUNT}/{CACHE_MODEL_DIR}"]
    if ctx.weights.revision is not None:
        args += ["--revision", ctx.weights.revision]
    args += ["--termination-log", TERMINATION_LOG]
    container: Manifest = {
        "name": "fetch",
        "image": ctx.worker_image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["omnipipe"],
        "args": args,
        "env": [
            # The Hub's own cache and lock files: scratch space, not the claim.
            {"name": "HF_HOME", "value": "/tmp/huggingface"},
            {"name": "OMNIPIPE_CACHE_DIR", "value": "/tmp/omnipipe"},
            *_token_env(ctx),
        ],
        # The reason file wins; an unexpected crash leaves the log's tail instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [
            {"name": "weights", "mountPath": FETCH_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    meta = object_meta(ctx, fetch_job_for(ctx, model), labels)
    meta["annotations"] = {"omnipipe.io/model": model}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": ctx.fetch_backoff_limit,
            "template": {
                "metadata": {"labels": labels, "annotations": {"omnipipe.io/model": model}},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    # fsGroup makes the fresh claim writable by the non-root fetch.
                    "securityContext": pod_security_context(),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "weights",
                            "persistentVolumeClaim": {
                                "claimName": weights_claim_name(ctx.name, key)
                            },
                        },
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def build_weights_children(ctx: BuildContext) -> list[Manifest]:
    """Claim then Job, per cached model: the Job's pod mounts the claim."""
    children: list[Manifest] = []
    for model in cached_models(ctx):
        children.append(build_weights_claim(ctx, model))
        children.append(build_fetch_job(ctx, model))
    return children


def stage_weights(ctx: BuildContext, stage: ResolvedStage) -> StageWeights:
    """The read-only weights volume of a stage pod and where the worker finds the model
    in it; for download, only the Hub token (the pod downloads as before)."""
    w = ctx.weights
    mount = {"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": True}
    if w.source is WeightsSource.CACHE:
        claim = weights_claim_name(ctx.name, cache_key(ctx, stage.model))
        volume: Manifest = {
            "name": "weights",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
        }
        path = f"{WEIGHTS_DIR}/{CACHE_MODEL_DIR}"
    elif w.source is WeightsSource.DOWNLOAD or stage.model != ctx.pipeline.model:
        # Claim and image hold spec.model; a stage with a model of its own downloads it.
        return StageWeights(env=tuple(_token_env(ctx)))
    elif w.source is WeightsSource.CLAIM:
        assert w.claim_name is not None
        volume = {
            "name": "weights",
            "persistentVolumeClaim": {"claimName": w.claim_name, "readOnly": True},
        }
        path = f"{WEIGHTS_DIR}/{w.path}" if w.path else WEIGHTS_DIR
    else:
        assert w.image is not None
        # Image volumes are always read-only; IfNotPresent: one pull per node.
        volume = {"name": "weights", "image": {"reference": w.image, "pullPolicy": "IfNotPresent"}}
        path = f"{WEIGHTS_DIR}/{w.path}" if w.path else WEIGHTS_DIR
    return StageWeights(
        volumes=(volume,), mounts=(mount,), env=({"name": MODEL_PATH_ENV, "value": path},)
    )
