"""Merge a pipeline type's default stages with the user's overrides.

The result is what the operator writes into the ConfigMap and what `omnipipe serve`
runs: workers and the router read it, never the raw resource.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    FieldSerializationInfo,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
)

from omnipipe.api.acceleration import Acceleration
from omnipipe.api.adapters import Adapter
from omnipipe.api.constants import DEFAULT_DENOISER_BATCH_WAIT_MS, DEFAULT_MAX_BATCH
from omnipipe.api.families import StageDefaults, pipeline_types
from omnipipe.api.pipelines import placement_groups, stage_order
from omnipipe.api.resource import OmniPipeline
from omnipipe.api.roles import Engine, Role
from omnipipe.api.spec import Router, Tracing, Transfer, Videos
from omnipipe.api.stage_spec import Autoscaling, EnvVar, MediaLimits, Metric, Stage, Toleration

TINY_SCHEME = "tiny://"
DEFAULT_TARGETS = {
    Metric.INFLIGHT: 4.0,
    Metric.QUEUE_WAIT_P90: 1.0,
    Metric.KV_CACHE_USAGE: 0.8,
    Metric.VIDEO_JOBS: 2.0,
    Metric.FIRST_AUDIO_P90: 1.0,
    Metric.PROMQL: 1.0,
}


class ResolvedModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ResolvedStage(ResolvedModel):
    name: str
    role: Role
    engine: Engine
    model: str
    inputs: tuple[str, ...]
    replicas: int
    cpu: str | None
    memory: str | None
    gpus: int
    engine_args: dict[str, Any]
    sampling: dict[str, Any]
    env: tuple[EnvVar, ...]
    node_selector: dict[str, str]
    tolerations: tuple[Toleration, ...]
    autoscaling: Autoscaling | None
    target: float | None
    # Defaults, so that a pipeline file an older operator wrote still loads.
    max_batch: int = DEFAULT_MAX_BATCH
    batch_wait_ms: int = 0
    # The limits the spec sets; each unset one (absent from model_fields_set) the worker
    # derives from its model at load, so a written pipeline carries the set ones only.
    media: MediaLimits = MediaLimits()
    # Left out of the written stage when unset, so that a pipeline without it keeps its
    # files and config hashes (an operator upgrade must not roll every pipeline).
    acceleration: Acceleration | None = None
    # The LoRA adapters that apply to this stage; left out when none, as acceleration is.
    adapters: tuple[Adapter, ...] = ()

    @model_serializer(mode="wrap")
    def _without_unset_acceleration(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            if self.acceleration is None:
                data.pop("acceleration", None)
            if not self.adapters:
                data.pop("adapters", None)
        return data

    @field_serializer("media")
    def _media_as_set(self, media: MediaLimits, info: FieldSerializationInfo) -> dict[str, Any]:
        return media.model_dump(mode=info.mode, by_alias=info.by_alias, exclude_unset=True)

    @property
    def autoscaled(self) -> bool:
        return self.autoscaling is not None

    def restart_fields(self) -> dict[str, Any]:
        """What a running worker of this stage was started with: all but its count and
        its LoRA adapters, which running workers load and unload. A thinker is the
        exception in part: vLLM enables LoRA as its engine starts, so whether the stage
        has adapters at all needs a new worker."""
        fields = self.model_dump(
            mode="json", exclude={"replicas", "autoscaling", "target", "adapters"}
        )
        if self.role is Role.THINKER and self.adapters:
            fields["loraEngine"] = True
        return fields

    @property
    def wakes_on_demand(self) -> bool:
        """The autoscaler may take it to zero replicas and brings it back for a request
        the router holds, so having no replica is a state it serves from."""
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0


class ResolvedGroup(ResolvedModel):
    """Stages that run in one process (spec.placement), scaled as one."""

    name: str
    stages: tuple[str, ...]
    replicas: int


class ResolvedPipeline(ResolvedModel):
    """A fully specified pipeline: every stage concrete, in dependency order."""

    name: str
    namespace: str
    model: str
    pipeline: str
    stages: tuple[ResolvedStage, ...]
    router: Router
    transfer: Transfer
    tracing: Tracing = Tracing()
    videos: Videos = Videos()
    groups: tuple[ResolvedGroup, ...] = ()

    @model_serializer(mode="wrap")
    def _without_groups_when_disaggregated(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out when empty, so a disaggregated pipeline keeps its file and its hashes.
        data = handler(self)
        if isinstance(data, dict) and not self.groups:
            data.pop("groups", None)
        return data

    def stage(self, name: str) -> ResolvedStage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"pipeline {self.name} has no stage {name!r}")

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return tuple(a for s in self.stages for a in s.adapters)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Stages no other stage consumes: they produce what users see."""
        consumed = {i for s in self.stages for i in s.inputs}
        return tuple(s.name for s in self.stages if s.name not in consumed)


def is_tiny(model: str) -> bool:
    return model.startswith(TINY_SCHEME)


def _quantity(value: str | int | None) -> str | None:
    return None if value is None else str(value)


def _base_stage(name: str, model: str, default: StageDefaults | None) -> dict[str, Any]:
    """The stage as its pipeline type defines it, or an empty shell for an added stage."""
    tiny = is_tiny(model)
    if default is None:
        return {"name": name, "inputs": (), "gpus": 0, "engine_args": {}}
    return {
        "name": name,
        "role": default.role,
        "engine": default.engine,
        "inputs": default.inputs,
        "gpus": 0 if tiny else default.gpus,
        "engine_args": dict(default.engine_args),
    }


def _resolve_stage(
    model: str, default: StageDefaults | None, user: Stage, adapters: tuple[Adapter, ...]
) -> ResolvedStage:
    stage_model = user.model or model
    fields = _base_stage(user.name, stage_model, default)
    if user.role is not None:
        fields["role"] = user.role
    if user.engine is not None:
        fields["engine"] = user.engine
    if user.inputs is not None:
        fields["inputs"] = tuple(user.inputs)
    res = user.resources
    if res is not None and res.gpus is not None:
        fields["gpus"] = res.gpus
    fields["engine_args"].update(user.engine_args or {})
    scaling = user.autoscaling
    if user.replicas is not None:
        replicas = user.replicas
    else:
        replicas = scaling.min_replicas if scaling else 1
    return ResolvedStage(
        **fields,
        model=stage_model,
        replicas=replicas,
        cpu=_quantity(res.cpu if res else None),
        memory=_quantity(res.memory if res else None),
        sampling=user.sampling.model_dump(exclude_none=True) if user.sampling else {},
        env=tuple(user.env or ()),
        node_selector=dict(user.node_selector or {}),
        tolerations=tuple(user.tolerations or ()),
        autoscaling=scaling,
        target=(scaling.target or DEFAULT_TARGETS[scaling.metric]) if scaling else None,
        max_batch=user.max_batch or DEFAULT_MAX_BATCH,
        media=user.media or MediaLimits(),
        # Written only when it sets something: `acceleration: {}` rolls nothing.
        acceleration=(
            user.acceleration if user.acceleration and user.acceleration.sets_anything else None
        ),
        adapters=adapters,
        batch_wait_ms=(
            user.batch_wait_ms
            if user.batch_wait_ms is not None
            else DEFAULT_DENOISER_BATCH_WAIT_MS
            if fields.get("role") is Role.DENOISER
            else 0
        ),
    )


def resolve(resource: OmniPipeline) -> ResolvedPipeline:
    """The pipeline type's defaults merged with the user's stage entries."""
    spec = resource.spec
    known = pipeline_types().get(spec.pipeline)
    defaults = {s.name: s for s in known.stages} if known else {}
    users = {s.name: s for s in spec.stages}
    groups = tuple(
        ResolvedGroup(name=name, stages=tuple(members), replicas=replicas)
        for name, members, replicas in placement_groups(spec)
    )
    group_replicas = {s: g.replicas for g in groups for s in g.stages}
    stages = tuple(
        _resolve_stage(
            spec.model,
            defaults.get(name),
            users.get(name, Stage(name=name)),
            tuple(a for a in spec.adapters if a.stage == name),
        )
        for name in stage_order(spec)
    )
    # A member runs as many workers as its group has processes.
    stages = tuple(
        s.model_copy(update={"replicas": group_replicas[s.name]}) if s.name in group_replicas else s
        for s in stages
    )
    return ResolvedPipeline(
        name=resource.metadata.name,
        namespace=resource.metadata.namespace,
        model=spec.model,
        pipeline=spec.pipeline,
        stages=stages,
        router=spec.router,
        transfer=spec.transfer,
        tracing=spec.tracing,
        videos=spec.videos,
        groups=groups,
    )
