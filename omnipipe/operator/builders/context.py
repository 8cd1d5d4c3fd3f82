"""The one frozen input of every builder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnipipe.api import OmniPipeline, ResolvedPipeline, resolve
from omnipipe.api import constants as c
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.weights import Weights
from omnipipe.operator.settings import OperatorSettings


@dataclass(frozen=True)
class OwnerRef:
    name: str
    uid: str

    def as_manifest(self) -> dict[str, object]:
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class BuildContext:
    pipeline: ResolvedPipeline
    worker_image: str
    router_image: str
    image_pull_policy: str
    termination_grace_seconds: int
    prometheus_url: str
    stage_network_policy: bool
    metrics_scrape_from: tuple[dict[str, Any], ...]
    # None when rendering without a cluster: there is no uid to point at yet.
    owner: OwnerRef | None
    weights: Weights = field(default_factory=Weights)
    fetch_backoff_limit: int = 6
    # Names of the fetch Jobs that have succeeded (observed by the reconcile layer):
    # the stages whose claim they filled may start.
    fetched: frozenset[str] = frozenset()
    # The Redis of video pipelines' routers (the operator's setting).
    video_store: str | None = None

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def namespace(self) -> str:
        return self.pipeline.namespace

    @property
    def revision(self) -> str:
        """The revision these children build: the pipeline's update revision."""
        return pipeline_revision(self.pipeline)


def build_context(
    resource: OmniPipeline, settings: OperatorSettings, fetched: frozenset[str] = frozenset()
) -> BuildContext:
    meta = resource.metadata
    images = resource.spec.images
    return BuildContext(
        pipeline=resolve(resource),
        worker_image=images.worker or settings.worker_image,
        router_image=images.router or settings.router_image,
        image_pull_policy=settings.image_pull_policy,
        termination_grace_seconds=settings.termination_grace_seconds,
        prometheus_url=resource.spec.prometheus_url or settings.prometheus_url,
        stage_network_policy=settings.stage_network_policy,
        metrics_scrape_from=tuple(settings.metrics_scrape_from),
        owner=OwnerRef(meta.name, meta.uid) if meta.uid else None,
        weights=resource.spec.weights,
        fetch_backoff_limit=settings.fetch_backoff_limit,
        fetched=fetched,
        video_store=settings.video_store,
    )
