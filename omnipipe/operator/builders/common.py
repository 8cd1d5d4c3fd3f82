"""Pieces every child manifest shares: metadata, pod hardening, config mount."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omnipipe.api import constants as c
from omnipipe.api.names import config_object_name, credential_secret_name
from omnipipe.operator.builders.context import BuildContext

Manifest = dict[str, Any]
RUN_AS = 10001


def object_meta(ctx: BuildContext, name: str, labels: dict[str, str]) -> Manifest:
    meta: Manifest = {"name": name, "namespace": ctx.namespace, "labels": dict(labels)}
    if ctx.owner is not None:
        meta["ownerReferences"] = [ctx.owner.as_manifest()]
    return meta


def content_hash(value: object) -> str:
    """Stable short hash of JSON-able data; a pod template annotation that rolls pods
    exactly when the config they read changes."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def pod_security_context() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(read_only_root: bool) -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def config_volume(ctx: BuildContext) -> Manifest:
    return {"name": "config", "configMap": {"name": config_object_name(ctx.name, ctx.revision)}}


def secret_env(name: str, secret: str, key: str) -> Manifest:
    """An environment variable read from a key of a Secret."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def credential_env(ctx: BuildContext) -> Manifest:
    """The pipeline credential, from the Secret the operator creates once per pipeline."""
    return secret_env(c.CREDENTIAL_ENV, credential_secret_name(ctx.name), c.CREDENTIAL_SECRET_KEY)


def config_mount() -> Manifest:
    return {"name": "config", "mountPath": c.CONFIG_DIR, "readOnly": True}


def pipeline_file_args(command: str) -> list[str]:
    """Container args as a list: no field of the resource ever reaches a shell."""
    return [command, "--pipeline", f"{c.CONFIG_DIR}/{c.CONFIG_FILE}"]


def http_probe(path: str, port: str, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }
