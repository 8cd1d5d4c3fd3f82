"""Thin kopf handlers: they pick what to reconcile and hand it to reconcile.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import httpx
import kopf
from prometheus_client import start_http_server

from omnipipe.api import ManifestError
from omnipipe.api import constants as c
from omnipipe.operator.autoscaler.source import PrometheusSource
from omnipipe.operator.k8s import Kube, NamespaceTerminating
from omnipipe.operator.logs import configure_operator_logging
from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.operator.reconcile import reconcile, refresh_status
from omnipipe.operator.scaling import autoscale
from omnipipe.operator.settings import OperatorSettings


def build_registry(
    settings: OperatorSettings, kube: Kube, metrics: OperatorMetrics, prom: PrometheusSource
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    resource = (c.GROUP, c.VERSION, c.PLURAL)
    # Everything that writes one pipeline's children or status (change handlers, the
    # drift and autoscale timers, child-event status refreshes) takes its lock, so no
    # writer works from a view another is about to replace.
    locks: dict[tuple[str, str], asyncio.Lock] = {}

    def pipeline_lock(namespace: str, name: str) -> asyncio.Lock:
        return locks.setdefault((namespace, name), asyncio.Lock())

    # Pipelines with a status refresh waiting (status_refresh_delay_seconds, then the
    # lock): a burst of Deployment events costs one refresh, not one each.
    refresh_queued: set[tuple[str, str]] = set()
    fetch_queued: set[tuple[str, str]] = set()

    def body_lock(body: Mapping[str, Any]) -> asyncio.Lock:
        return pipeline_lock(body["metadata"]["namespace"], body["metadata"]["name"])

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In a pod: the mounted ServiceAccount token; elsewhere: KUBECONFIG.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=c.GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        # A pipeline deleted while one of its timers runs (a drift reconcile, an
        # autoscale step) keeps its finalizer until kopf sees that timer end; kopf looks
        # again every cancellation_polling seconds, 60 by default: a deletion took a
        # minute longer under load. The timers end within seconds, so look every second.
        settings.background.cancellation_polling = 1.0

    async def _reconcile(body: Mapping[str, Any], memo: kopf.Memo, trigger: str) -> dict[str, Any]:
        if body.get("metadata", {}).get("deletionTimestamp"):
            # Being deleted: the garbage collector removes the children; applying them
            # again would race it (and fails in a terminating namespace).
            return {}
        async with body_lock(body):
            started = time.monotonic()
            try:
                result = await reconcile(kube, settings, body, metrics)
            except NamespaceTerminating:
                # The namespace's deletion takes the pipeline and its children with it.
                return {}
            except ManifestError as exc:
                metrics.reconciles.labels(trigger, "error").inc()
                metrics.reconcile_errors.labels(type(exc).__name__).inc()
                # Only reachable when the CRD's validation was bypassed; retrying won't help.
                raise kopf.PermanentError(str(exc)) from exc
            except Exception as exc:
                metrics.reconciles.labels(trigger, "error").inc()
                metrics.reconcile_errors.labels(type(exc).__name__).inc()
                raise
            finally:
                metrics.reconcile_seconds.labels(trigger).observe(time.monotonic() - started)
        metrics.reconciles.labels(trigger, "success").inc()
        return {"ready": result.ready}

    @kopf.on.create(*resource, registry=registry, id="create")
    async def on_create(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Any]:
        return await _reconcile(body, memo, "create")

    @kopf.on.update(*resource, registry=registry, id="update")
    async def on_update(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Any]:
        return await _reconcile(body, memo, "update")

    @kopf.on.resume(*resource, registry=registry, id="resume")
    async def on_resume(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Any]:
        return await _reconcile(body, memo, "resume")

    @kopf.timer(
        *resource,
        registry=registry,
        id="drift",
        interval=settings.drift_check_seconds,
        initial_delay=settings.drift_check_seconds,
    )
    async def drift(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await _reconcile(body, memo, "drift")

    @kopf.timer(
        *resource,
        registry=registry,
        id="autoscale",
        interval=settings.autoscale_interval_seconds,
        initial_delay=1.0,
    )
    async def autoscale_stages(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        if body.get("metadata", {}).get("deletionTimestamp"):
            return
        if not any(s.get("autoscaling") for s in body.get("spec", {}).get("stages", [])):
            return  # nothing to scale: no API call every interval for every pipeline
        history = memo.setdefault("scaling_history", {})
        async with body_lock(body):
            # A namespace being deleted takes the pipeline with it: nothing to scale.
            with contextlib.suppress(NamespaceTerminating):
                meta = body["metadata"]
                await autoscale(
                    kube, prom, settings, meta["namespace"], meta["name"], history, metrics
                )

    async def refresh_soon(body: kopf.Body) -> None:
        labels = body.get("metadata", {}).get("labels", {})
        pipeline = labels.get(c.LABEL_PIPELINE)
        if not pipeline:
            return
        key = (body["metadata"]["namespace"], pipeline)
        if key in refresh_queued:
            return  # a refresh that has not started yet reads the state this event shows
        refresh_queued.add(key)
        try:
            await asyncio.sleep(settings.status_refresh_delay_seconds)
            async with pipeline_lock(*key):
                refresh_queued.discard(key)  # events from now on need a refresh of their own
                # A refresh may post an Event (a fetch's outcome, a revision switch); in a
                # namespace being deleted there is nothing left to tell.
                with contextlib.suppress(NamespaceTerminating):
                    await refresh_status(kube, settings, key[0], key[1], metrics)
        finally:
            refresh_queued.discard(key)

    @kopf.on.event(
        "apps", "v1", "deployments", registry=registry, labels={c.LABEL_MANAGED_BY: c.MANAGER}
    )
    async def child_changed(body: kopf.Body, **_: Any) -> None:
        await refresh_soon(body)

    # A pod's waits (an image pull, a crash loop, no node) move Stalled, and a
    # Deployment's status does not change while its pod crash-loops.
    @kopf.on.event("", "v1", "pods", registry=registry, labels={c.LABEL_MANAGED_BY: c.MANAGER})
    async def pod_changed(body: kopf.Body, **_: Any) -> None:
        if body.get("metadata", {}).get("labels", {}).get(c.LABEL_COMPONENT) in (
            c.COMPONENT_STAGE,
            c.COMPONENT_ROUTER,
        ):
            await refresh_soon(body)

    @kopf.on.event("batch", "v1", "jobs", registry=registry, labels={c.LABEL_MANAGED_BY: c.MANAGER})
    async def fetch_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        """A fetch Job moved: a full reconcile, since a filled claim lets its stages'
        Deployments be created, and a failed attempt shows in ModelCached."""
        labels = body.get("metadata", {}).get("labels", {})
        pipeline = labels.get(c.LABEL_PIPELINE)
        if not pipeline:
            return
        key = (body["metadata"]["namespace"], pipeline)
        if key in fetch_queued:
            return
        fetch_queued.add(key)
        try:
            await asyncio.sleep(settings.status_refresh_delay_seconds)
            fetch_queued.discard(key)
            owner = await kube.get_pipeline(*key)
            if owner is not None:
                await _reconcile(owner, kopf.Memo(), "fetch")
        finally:
            fetch_queued.discard(key)

    return registry


def run_operator(settings: OperatorSettings) -> None:
    """Run until interrupted: `omnipipe operator`."""
    configure_operator_logging()

    metrics = OperatorMetrics.create()
    start_http_server(settings.metrics_port, registry=metrics.registry)

    async def main() -> None:
        kube = Kube.from_environment()
        http = httpx.AsyncClient()
        prom = PrometheusSource(http)
        try:
            await kopf.operator(
                registry=build_registry(settings, kube, metrics, prom),
                clusterwide=settings.namespace is None,
                namespaces=[settings.namespace] if settings.namespace else (),
                standalone=settings.peering is None,
                peering_name=settings.peering,
                # Distinct priorities: the highest-priority replica is the active one.
                priority=random.randint(1, 1_000_000),
                liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz",
            )
        finally:
            await http.aclose()
            await kube.close()

    asyncio.run(main())
