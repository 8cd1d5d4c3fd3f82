"""Pydantic models of the OmniPipeline resource: the single source of the CRD.

Field docstrings become the CRD's descriptions (``kubectl explain``). Validators here
mirror the CRD's CEL rules so that ``omnipipe serve`` and ``omnipipe render`` reject the
same manifests the API server does.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from omnipipe.api import constants as c
from omnipipe.api.adapters import MAX_ADAPTERS, Adapter
from omnipipe.api.pipelines import check_stage_graph
from omnipipe.api.placement_spec import Placement

# Re-exported: the resource's stages are written in these words.
from omnipipe.api.roles import Engine as Engine
from omnipipe.api.roles import Role as Role
from omnipipe.api.spec_base import DnsLabel, SpecModel
from omnipipe.api.stage_spec import Stage
from omnipipe.api.weights import Weights


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class TransferBackend(StrEnum):
    UCX = "ucx"
    TCP = "tcp"


class SecretKeyRef(SpecModel):
    """A key of a Secret in the pipeline's namespace."""

    name: DnsLabel
    """Secret name."""
    key: Annotated[str, Field(min_length=1, max_length=253)] = "api-key"
    """Key inside the Secret."""


class Router(SpecModel):
    """The OpenAI-compatible router in front of the stages."""

    replicas: Annotated[int, Field(ge=1, le=100)] = 1
    """Router replicas."""
    service_type: ServiceType = ServiceType.CLUSTER_IP
    """Type of the router's Service: ClusterIP, NodePort or LoadBalancer."""
    api_key_secret_ref: SecretKeyRef | None = None
    """When set, clients must send this Secret's value as a Bearer token."""
    admin_key_secret_ref: SecretKeyRef | None = None
    """When set, the `/admin` API takes this Secret's value as its Bearer token instead of
    the API key, so the API's clients cannot pause, sleep or reload the stages."""

    @model_serializer(mode="wrap")
    def _without_unset_admin_key(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out when unset, so a pipeline without one keeps its file and its hashes.
        data = handler(self)
        if isinstance(data, dict) and self.admin_key_secret_ref is None:
            data.pop("admin_key_secret_ref", None)
            data.pop("adminKeySecretRef", None)
        return data


class Transfer(SpecModel):
    """How stages hand tensors to each other."""

    backend: TransferBackend = TransferBackend.UCX
    """ucx (ucxx: shared memory, CMA, TCP or RDMA) or tcp (asyncio sockets, the fallback)."""


class Tracing(SpecModel):
    """OpenTelemetry traces of every request: the router's span, and each stage's
    waiting, transfer-in, queue, engine and hand-off spans, exported with OTLP."""

    endpoint: Annotated[str, Field(pattern=r"^https?://", max_length=512)] | None = None
    """OTLP/HTTP endpoint of a collector, e.g. http://otel-collector.observability:4318
    (spans go to its /v1/traces). Unset: no traces are exported (a client's
    traceparent is still passed on to the stages)."""
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Share of requests traced, when the client sent no sampled traceparent; a client's
    sampling decision is kept."""

    def as_config(self) -> dict[str, Any]:
        """As the processes' configuration (and its hashes) carry it: empty when it is the
        default, so that untraced pipelines' files, hashes and pods stay what they were
        before tracing existed (an operator upgrade must not roll every pipeline), and
        turning it on or off rolls the pods that read it."""
        return {} if self == Tracing() else {"tracing": self.model_dump(mode="json")}


class StoreSecretRef(SecretKeyRef):
    """A key of a Secret in the pipeline's namespace that holds a Redis URL."""

    key: Annotated[str, Field(min_length=1, max_length=253)] = "url"
    """Key inside the Secret."""


MAX_UNFINISHED_JOBS = 1000


class Videos(SpecModel):
    """A video pipeline's jobs (/v1/videos), which its routers keep in Redis."""

    ttl_seconds: Annotated[int, Field(ge=60, le=30 * 86400)] = 86400
    """How long a finished video job and its MP4 are kept (a day by default, at most 30)."""
    max_unfinished_jobs: Annotated[int, Field(ge=1, le=1_000_000)] = MAX_UNFINISHED_JOBS
    """Jobs queued or running at once, across the router's replicas: a create past it is
    a 429 with Retry-After, so a flood of creates cannot grow the queue (and Redis)
    without end."""
    store_secret_ref: StoreSecretRef | None = None
    """The Redis the routers keep the jobs in, as a URL (redis://[:password@]host:6379/0,
    rediss:// with TLS) in a Secret: a password stays out of the pod spec. Unset: the
    operator's (the chart's operator.videoStore)."""

    def as_config(self) -> dict[str, Any]:
        """As the pipeline file and the router's hash carry it: empty at the default, and
        an unset store left out, so that pipelines' files and router pods stay what they
        were before either existed (maxUnfinishedJobs too, at its default)."""
        if self == Videos():
            return {}
        at_default = self.max_unfinished_jobs == MAX_UNFINISHED_JOBS
        later = {"max_unfinished_jobs"} if at_default else set()
        return {"videos": self.model_dump(mode="json", exclude_none=True, exclude=later)}


class Images(SpecModel):
    """Container image overrides; the operator's defaults apply otherwise."""

    worker: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    """Image of the stage workers."""
    router: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    """Image of the router."""


class OmniPipelineSpec(SpecModel):
    """Desired state of an omni-modality serving pipeline."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    """A Hugging Face model id, a local path, or tiny://NAME for a built-in tiny random model."""
    pipeline: Annotated[str, Field(min_length=1, max_length=63)]
    """Stage-graph type, e.g. qwen-image or qwen2.5-omni; custom: spec.stages defines all."""
    stages: Annotated[list[Stage], Field(max_length=c.MAX_STAGES)] = Field(default_factory=list)
    """Stage overrides and additions, keyed by name."""
    router: Router = Router()
    """Router settings."""
    transfer: Transfer = Transfer()
    """Stage-to-stage tensor transfer settings."""
    images: Images = Images()
    """Container image overrides."""
    tracing: Tracing = Tracing()
    """Request traces over OTLP; off unless an endpoint is set."""
    videos: Videos = Videos()
    """Video jobs, for pipelines that make videos (wan)."""
    prometheus_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """Prometheus the autoscaler queries for this pipeline; defaults to the operator's."""
    weights: Weights = Weights()
    """Where the stage pods find the model weights: downloaded by every pod (the
    default), an existing claim, a claim the operator fills once per model, or an image."""
    adapters: Annotated[list[Adapter], Field(max_length=MAX_ADAPTERS)] = Field(default_factory=list)
    """LoRA adapters, each on one denoiser or thinker stage, served as models of their own."""
    placement: Placement | None = None
    """Which stages share a process: each its own (the default), or colocated groups."""

    @model_validator(mode="after")
    def _graph(self) -> OmniPipelineSpec:
        check_stage_graph(self)
        return self
