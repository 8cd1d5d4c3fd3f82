"""The only module that talks to the Kubernetes API (besides kopf's own watching)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, cast

from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, PersistentVolumeClaim, Pod, Secret, Service
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.types import CascadeType, PatchType

from omnipipe.api import constants as c

Manifest = dict[str, Any]

OmniPipelineResource = create_namespaced_resource(c.GROUP, c.VERSION, c.KIND, c.PLURAL, verbs=None)
# lightkube's overloads are precise per resource class; a table of them is typed loosely.
ScaledObject = create_namespaced_resource("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")
CHILD_KINDS: dict[str, Any] = {
    "Deployment": Deployment,
    "Service": Service,
    "ConfigMap": ConfigMap,
    "HorizontalPodAutoscaler": HorizontalPodAutoscaler,
    "NetworkPolicy": NetworkPolicy,
    # Only where KEDA is installed; listing it elsewhere answers 404.
    "ScaledObject": ScaledObject,
    # weights.source cache: a claim per model and the Job that fills it.
    "PersistentVolumeClaim": PersistentVolumeClaim,
    "Job": Job,
}


class NamespaceTerminating(Exception):
    """The namespace is being deleted: nothing may be created in it any more."""


@contextlib.contextmanager
def _terminating_namespace_is_final() -> Iterator[None]:
    try:
        yield
    except ApiError as exc:
        if exc.status.code == 403 and "being terminated" in (exc.status.message or ""):
            raise NamespaceTerminating(exc.status.message) from exc
        raise


def _status_code(exc: Exception) -> int | None:
    """The HTTP status behind a client error: lightkube raises ApiError for most calls
    but a plain HTTP status error from list pagination."""
    if isinstance(exc, ApiError):
        return int(exc.status.code) if exc.status.code is not None else None
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if isinstance(code, int) else None


def _as_dict(obj: Any) -> Manifest:
    return cast(Manifest, obj.to_dict())


def _child_labels(pipeline: str) -> dict[str, Any]:
    return {c.LABEL_PIPELINE: pipeline, c.LABEL_MANAGED_BY: c.MANAGER}


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """Server-side apply, listing, deletion, events and status, all for one operator."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @classmethod
    def from_environment(cls) -> Kube:
        return cls(AsyncClient(field_manager=c.MANAGER))

    async def close(self) -> None:
        await self._client.close()

    async def apply(self, desired: Manifest) -> Manifest:
        """The one write path for children: server-side apply as omnipipe-operator."""
        obj = codecs.from_dict(desired)
        with _terminating_namespace_is_final():
            applied = await self._client.apply(obj, field_manager=c.MANAGER, force=True)
        return _as_dict(applied)

    async def create_secret_once(self, desired: Manifest) -> bool:
        """Create a Secret unless one of that name exists (then leave it as it is).

        Not apply(): the value is generated once and must never be overwritten, and this
        way the operator needs only `create` on Secrets, never `get`: it cannot read any
        Secret in the cluster, its own included. True when it was created."""
        obj = codecs.from_dict(desired)
        if not isinstance(obj, Secret):
            raise TypeError(f"not a Secret: {desired.get('kind')}")
        try:
            with _terminating_namespace_is_final():
                await self._client.create(obj)
        except ApiError as exc:
            if exc.status.code == 409:  # AlreadyExists
                return False
            raise
        return True

    async def list_children(self, namespace: str, pipeline: str) -> list[Manifest]:
        found: list[Manifest] = []
        for kind, res in CHILD_KINDS.items():
            try:
                async for obj in self._client.list(
                    res, namespace=namespace, labels=_child_labels(pipeline)
                ):
                    manifest = _as_dict(obj)
                    manifest.setdefault("kind", kind)
                    found.append(manifest)
            except Exception as exc:
                if _status_code(exc) != 404:  # 404: a kind this cluster does not serve
                    raise
        return found

    async def list_deployments(self, namespace: str, pipeline: str) -> list[Manifest]:
        return [
            _as_dict(obj)
            async for obj in self._client.list(
                Deployment, namespace=namespace, labels=_child_labels(pipeline)
            )
        ]

    async def list_fetches(
        self, namespace: str, pipeline: str
    ) -> tuple[list[Manifest], list[Manifest]]:
        """The pipeline's fetch Jobs and their pods. Pods only to read a failed fetch's
        termination message (its reason): the operator may list pods, never more."""
        selector = {**_child_labels(pipeline), c.LABEL_COMPONENT: c.COMPONENT_WEIGHTS}
        jobs = [
            _as_dict(o) async for o in self._client.list(Job, namespace=namespace, labels=selector)
        ]
        if not jobs:
            return [], []
        pods = [
            _as_dict(o) async for o in self._client.list(Pod, namespace=namespace, labels=selector)
        ]
        return jobs, pods

    async def list_pods(self, namespace: str, pipeline: str) -> list[Manifest]:
        """The pipeline's pods, read for why one cannot run (Stalled); never written."""
        return [
            _as_dict(o)
            async for o in self._client.list(
                Pod, namespace=namespace, labels=_child_labels(pipeline)
            )
        ]

    async def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None:
        """The autoscaler's only write: the Deployment's scale subresource."""
        with _terminating_namespace_is_final():
            await self._client.patch(
                Deployment.Scale,
                deployment,
                {"spec": {"replicas": replicas}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            # Background: a Job's pods go with it (the API's default for Jobs orphans them).
            await self._client.delete(
                CHILD_KINDS[kind], name, namespace=namespace, cascade=CascadeType.BACKGROUND
            )
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    async def get_pipeline(self, namespace: str, name: str) -> Manifest | None:
        try:
            obj = await self._client.get(OmniPipelineResource, name, namespace=namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise
        return _as_dict(obj)

    async def patch_status(self, namespace: str, name: str, status: Manifest) -> None:
        try:
            await self._client.patch(
                OmniPipelineResource.Status,
                name,
                {"status": status},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as exc:
            # Deleted meanwhile: there is no status left to keep.
            if exc.status.code != 404:
                raise

    async def post_event(
        self, owner: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        meta = owner["metadata"]
        now = utc_now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": c.API_VERSION,
                "kind": c.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": c.MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with _terminating_namespace_is_final():
            await self._client.create(cast(Any, codecs.from_dict(event)))
