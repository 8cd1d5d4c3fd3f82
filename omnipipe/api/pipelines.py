"""The rules a stage graph obeys, over the pipeline types the installed families register
(omnipipe.api.families)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from omnipipe.api.adapters import ADAPTER_ROLES, Adapter
from omnipipe.api.families import (
    CUSTOM,
    PipelineType,
    StageDefaults,
    family_for_checkpoint,
    installed_summary,
    pipeline_type_names,
    pipeline_types,
)
from omnipipe.api.placement_spec import IMPLICIT_GROUP, Placement
from omnipipe.api.roles import AUDIO_ROLES, Engine, Role
from omnipipe.api.stage_spec import Metric, Stage


class StageGraph(Protocol):
    """What these rules read of a spec; OmniPipelineSpec is one. A protocol, not the spec
    itself: the spec's validator runs these rules, so this module sits below it."""

    @property
    def pipeline(self) -> str: ...
    @property
    def stages(self) -> Sequence[Stage]: ...
    @property
    def adapters(self) -> Sequence[Adapter]: ...
    @property
    def placement(self) -> Placement | None: ...


def pipeline_for_checkpoint(kinds: Sequence[str]) -> str | None:
    """The pipeline type whose checkpoints say they are one of `kinds`."""
    found = family_for_checkpoint(kinds)
    return found[1].name if found else None


def default_stage_names(pipeline: str) -> tuple[str, ...]:
    known = pipeline_types().get(pipeline)
    return known.stage_names if known else ()


def stage_order(spec: StageGraph) -> list[str]:
    """Default stages in their defined order, then added stages in list order."""
    defaults = default_stage_names(spec.pipeline)
    return [*defaults, *(s.name for s in spec.stages if s.name not in defaults)]


def check_stage_graph(spec: StageGraph) -> None:
    """Raise ValueError naming the field when the stage graph is invalid.

    The same rules are CEL rules of the CRD (``omnipipe.api.crd_rules`` and
    ``omnipipe.api.crd_placement_rules``).
    """
    if spec.pipeline not in pipeline_type_names():
        raise ValueError(
            f"spec.pipeline: unknown pipeline type {spec.pipeline!r}; installed families: "
            f"{installed_summary()}; or {CUSTOM}"
        )
    names = [s.name for s in spec.stages]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"spec.stages: duplicate stage names: {', '.join(duplicates)}")
    if spec.pipeline == CUSTOM and not spec.stages:
        raise ValueError("spec.stages: a custom pipeline must define at least one stage")
    defaults = default_stage_names(spec.pipeline)
    for stage in spec.stages:
        if stage.name not in defaults and (stage.role is None or stage.engine is None):
            raise ValueError(
                f"spec.stages[{stage.name}]: role and engine are required for a stage "
                f"the {spec.pipeline} pipeline does not define"
            )
    _check_acceleration(spec)
    _check_first_audio(spec)
    _check_adapters(spec)
    _check_placement(spec)
    order = stage_order(spec)
    for stage in spec.stages:
        for upstream in stage.inputs or ():
            if upstream not in order:
                raise ValueError(
                    f"spec.stages[{stage.name}].inputs: {upstream!r} is not a stage of "
                    "this pipeline"
                )
            if order.index(upstream) >= order.index(stage.name):
                raise ValueError(
                    f"spec.stages[{stage.name}].inputs: {upstream!r} must be an earlier stage "
                    "(the stage graph may not have cycles)"
                )


def _check_adapters(spec: StageGraph) -> None:
    known = pipeline_types().get(spec.pipeline)
    roles: dict[str, Role | None] = {s.name: s.role for s in known.stages} if known else {}
    roles.update({s.name: s.role or roles.get(s.name) for s in spec.stages})
    names = [a.name for a in spec.adapters]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"spec.adapters: duplicate names: {', '.join(duplicates)}")
    for adapter in spec.adapters:
        if adapter.stage not in roles:
            raise ValueError(
                f"spec.adapters[{adapter.name}].stage: {adapter.stage!r} is not a stage of "
                "this pipeline"
            )
        role = roles[adapter.stage]
        if role not in ADAPTER_ROLES:
            what = role.value if role else "stage with no role"
            raise ValueError(
                f"spec.adapters[{adapter.name}].stage: LoRA adapters apply to a denoiser "
                f"or a thinker stage, not a {what} ({adapter.stage})"
            )
        if role is Role.THINKER and adapter.scale != 1.0:
            raise ValueError(
                f"spec.adapters[{adapter.name}].scale: vLLM applies an adapter of a thinker "
                f"whole; scale is for denoisers (leave it out, or 1), got {adapter.scale:g}"
            )


def _check_acceleration(spec: StageGraph) -> None:
    known = pipeline_types().get(spec.pipeline)
    roles = {s.name: s.role for s in known.stages} if known else {}
    for stage in spec.stages:
        role = stage.role or roles.get(stage.name)
        if stage.acceleration and role is not Role.DENOISER:
            what = role.value if role else "stage with no role"
            raise ValueError(
                f"spec.stages[{stage.name}].acceleration: step caching, CFG-parallel and "
                f"quantization apply to a denoiser stage, not a {what}"
            )
        gpus = stage.resources.gpus if stage.resources else None
        if stage.acceleration and stage.acceleration.cfg_parallel_size > 1 and gpus == 1:
            raise ValueError(
                f"spec.stages[{stage.name}].acceleration.cfgParallelSize: 2 needs two "
                "devices: resources.gpus of 2 or more, or none (the CPU)"
            )


def _check_first_audio(spec: StageGraph) -> None:
    """first-audio-p90 scales a stage that makes audio: elsewhere its series never exists
    and the autoscaler would hold the stage at its count for good."""
    known = pipeline_types().get(spec.pipeline)
    roles = {s.name: s.role for s in known.stages} if known else {}
    for stage in spec.stages:
        role = stage.role or roles.get(stage.name)
        scaling = stage.autoscaling
        if scaling and scaling.metric is Metric.FIRST_AUDIO_P90 and role not in AUDIO_ROLES:
            what = role.value if role else "stage with no role"
            raise ValueError(
                f"spec.stages[{stage.name}].autoscaling.metric: first-audio-p90 is timed by "
                f"a talker or code2wav stage, not a {what}"
            )


def placement_groups(spec: StageGraph) -> list[tuple[str, list[str], int]]:
    """(name, stages, replicas) of each colocated group; none when disaggregated."""
    placement = spec.placement
    if placement is None or placement.mode != "colocated":
        return []
    if not placement.groups:
        return [(IMPLICIT_GROUP, stage_order(spec), 1)]
    order = stage_order(spec)
    # In stage order, however listed: members load in it, and a reordered list is no change.
    return [
        (
            g.name,
            sorted(g.stages or order, key=lambda s: order.index(s) if s in order else -1),
            g.replicas,
        )
        for g in placement.groups
    ]


def _check_placement(spec: StageGraph) -> None:
    placement = spec.placement
    if placement is None:
        return
    if placement.groups and placement.mode != "colocated":
        raise ValueError("spec.placement.groups: groups need mode colocated")
    if len(placement.groups) > 1 and any(g.stages is None for g in placement.groups):
        raise ValueError("spec.placement.groups: with several groups, each lists its stages")
    names = [g.name for g in placement.groups]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"spec.placement.groups: duplicate group names: {', '.join(duplicates)}")
    order = stage_order(spec)
    known = pipeline_types().get(spec.pipeline)
    engines: dict[str, Engine | None] = {s.name: s.engine for s in known.stages} if known else {}
    engines.update({s.name: s.engine or engines.get(s.name) for s in spec.stages})
    users = {s.name: s for s in spec.stages}
    home: dict[str, str] = {}
    for name, stages, _ in placement_groups(spec):
        if name in order:
            raise ValueError(
                f"spec.placement.groups[{name}].name: {name} is a stage name; a group needs "
                "a name of its own"
            )
        if len(stages) < 2:
            raise ValueError(f"spec.placement.groups[{name}]: a group holds at least two stages")
        for stage in stages:
            if stage not in order:
                raise ValueError(
                    f"spec.placement.groups[{name}].stages: {stage!r} is not a stage of this "
                    "pipeline"
                )
            if stage in home:
                raise ValueError(
                    f"spec.placement.groups: {stage} is in groups {home[stage]} and {name}; a "
                    "stage runs in one process"
                )
            home[stage] = name
            user = users.get(stage)
            if user is not None and (user.replicas is not None or user.autoscaling is not None):
                where = (
                    f"spec.placement.groups[{name}]"
                    if placement.groups
                    else f"spec.placement.groups: [{{name: {name}, replicas: N}}]"
                )
                raise ValueError(
                    f"spec.stages[{stage}].replicas: {stage} runs in group {name}; a group "
                    f"scales as one: set replicas on {where}"
                )
        on_vllm = [s for s in stages if engines.get(s) is Engine.VLLM]
        if len(on_vllm) > 1:
            raise ValueError(
                f"spec.placement.groups[{name}]: {' and '.join(on_vllm)} both run on vLLM; a "
                "process holds one vLLM engine (vLLM keeps process-wide state)"
            )


__all__ = [
    "CUSTOM",
    "PipelineType",
    "StageDefaults",
    "StageGraph",
    "check_stage_graph",
    "default_stage_names",
    "pipeline_for_checkpoint",
    "stage_order",
]
