"""The CRD's CEL rules (x-kubernetes-validations), but spec.placement's
(api/crd_placement_rules.py): the API server's copy of the models' validators and of
api/pipelines.py, so that `kubectl apply` refuses what `omnipipe serve` refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from omnipipe.api import constants as c
from omnipipe.api.adapters import ADAPTER_ROLES
from omnipipe.api.crd_structural import Schema
from omnipipe.api.families import CUSTOM, pipeline_types
from omnipipe.api.resource import MAX_PIPELINE_NAME
from omnipipe.api.roles import AUDIO_ROLES, Role
from omnipipe.api.stage_spec import Metric


def cel_str_list(items: tuple[str, ...] | list[str]) -> str:
    """A CEL list literal of strings."""
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _rank(var: str, names: tuple[str, ...]) -> str:
    """CEL for the position of `var` among the default stage names (a ternary chain:
    the cost estimator prices list.indexOf far above the budget)."""
    expr = str(len(names))
    for pos, name in reversed(list(enumerate(names))):
        expr = f"({var} == {json.dumps(name)} ? {pos} : {expr})"
    return expr


def _role_rule(defaults: tuple[str, ...]) -> str:
    d = cel_str_list(defaults)
    return f"self.stages.all(s, s.name in {d} || (has(s.role) && has(s.engine)))"


def _input_exists_rule(defaults: tuple[str, ...]) -> str:
    d = cel_str_list(defaults)
    return (
        f"self.stages.all(s, !has(s.inputs) || s.inputs.all(n, n in {d} || "
        "self.stages.exists(t, t.name == n)))"
    )


def _input_earlier_rule(defaults: tuple[str, ...]) -> str:
    """Stage order is the default stages first, then added stages in list order."""
    d = cel_str_list(defaults)
    return (
        f"self.stages.all(k, s, !has(s.inputs) || s.inputs.all(n, (n in {d}) ? "
        f"(!(s.name in {d}) || {_rank('n', defaults)} < {_rank('s.name', defaults)}) : "
        f"(!(s.name in {d}) && self.stages.exists(j, t, t.name == n && j < k))))"
    )


def _per_pipeline(
    rule: Callable[[tuple[str, ...]], str], message: str, reason: str
) -> list[Schema]:
    """A stage-graph rule specialised for each pipeline type's default stage names, one
    CEL rule per type (and one for types with no defaults): the API server prices each
    rule against a budget, and one rule over every type outgrows it as types are added."""
    known = cel_str_list(list(pipeline_types()))
    conditions = [
        (f"self.pipeline != {json.dumps(name)}", p.stage_names)
        for name, p in pipeline_types().items()
    ]
    conditions.append((f"self.pipeline in {known}", ()))
    return [
        {
            "rule": f"{skip} || !has(self.stages) || {rule(defaults)}",
            "message": message,
            "fieldPath": ".stages",
            "reason": reason,
        }
        for skip, defaults in conditions
    ]


def _adapters_on_denoisers() -> list[Schema]:
    """spec.adapters[].stage names a denoiser or a thinker: a stage of the spec with that
    role (or, without a role, one of its type's such stages), or such a stage of its type
    that the spec does not give another role; one rule per type, as _per_pipeline's."""
    known = cel_str_list(list(pipeline_types()))
    roles = cel_str_list(sorted(r.value for r in ADAPTER_ROLES))
    typed = [
        (
            f"self.pipeline != {json.dumps(name)}",
            cel_str_list([s.name for s in p.stages if s.role in ADAPTER_ROLES]),
        )
        for name, p in pipeline_types().items()
    ]
    typed.append((f"self.pipeline in {known}", "[]"))
    return [
        {
            "rule": f"{skip} || !has(self.adapters) || self.adapters.all(a, "
            "(has(self.stages) && self.stages.exists(s, s.name == a.stage && "
            f"(has(s.role) ? s.role in {roles} : s.name in {names}))) || "
            f"(a.stage in {names} && (!has(self.stages) || !self.stages.exists(s, "
            f"s.name == a.stage && has(s.role) && !(s.role in {roles})))))",
            "message": "spec.adapters[].stage: LoRA adapters apply to a denoiser or a "
            "thinker stage of this pipeline",
            "fieldPath": ".adapters",
            "reason": "FieldValueInvalid",
        }
        for skip, names in typed
    ]


def _thinker_adapters_whole() -> list[Schema]:
    """An adapter on a thinker (its spec role, or its type's role for a stage the spec
    gives none) has no scale but 1: vLLM applies it whole."""
    thinker = json.dumps(Role.THINKER.value)
    rules: list[Schema] = []
    for name, p in pipeline_types().items():
        thinkers = [s.name for s in p.stages if s.role is Role.THINKER]
        if not thinkers:
            continue
        names = cel_str_list(thinkers)
        rules.append(
            {
                "rule": f"self.pipeline != {json.dumps(name)} || !has(self.adapters) || "
                "self.adapters.all(a, !has(a.scale) || a.scale == 1.0 || !("
                "(has(self.stages) && self.stages.exists(s, s.name == a.stage && "
                f"(has(s.role) ? s.role == {thinker} : s.name in {names}))) || "
                f"(a.stage in {names} && !(has(self.stages) && self.stages.exists(s, "
                "s.name == a.stage && has(s.role))))))",
                "message": "spec.adapters[].scale: vLLM applies an adapter of a thinker "
                "whole; scale is for denoisers",
                "fieldPath": ".adapters",
                "reason": "FieldValueInvalid",
            }
        )
    return rules


def _on_roles(present: str, roles: frozenset[Role], message: str) -> list[Schema]:
    """A stage field (`present` is CEL over the stage `s`) set only on a stage of one of
    the roles: its own role, or its type's default role for a stage it names; one rule
    per type, as _per_pipeline's."""
    known = cel_str_list(list(pipeline_types()))
    allowed = cel_str_list(sorted(r.value for r in roles))
    typed = [
        (f"self.pipeline != {json.dumps(name)}", [s.name for s in p.stages if s.role in roles])
        for name, p in pipeline_types().items()
    ]
    typed.append((f"self.pipeline in {known}", []))
    return [
        {
            "rule": f"{skip} || !has(self.stages) || self.stages.all(s, !({present}) || "
            f"(has(s.role) ? s.role in {allowed} : s.name in {cel_str_list(names)}))",
            "message": message,
            "fieldPath": ".stages",
            "reason": "FieldValueInvalid",
        }
        for skip, names in typed
    ]


def stage_graph_rules() -> list[Schema]:
    """spec's own rules: its stage graph, acceleration and adapters."""
    return [
        {
            "rule": "!has(self.stages) || "
            "self.stages.all(s, self.stages.exists_one(t, t.name == s.name))",
            "message": "stage names must be unique",
            "fieldPath": ".stages",
            "reason": "FieldValueDuplicate",
        },
        {
            "rule": f"self.pipeline != {json.dumps(CUSTOM)} || "
            "(has(self.stages) && size(self.stages) > 0)",
            "message": "a custom pipeline must define at least one stage",
            "fieldPath": ".stages",
            "reason": "FieldValueRequired",
        },
        *_per_pipeline(
            _role_rule,
            "role and engine are required for a stage the pipeline type does not define",
            "FieldValueRequired",
        ),
        *_per_pipeline(
            _input_exists_rule,
            "every input must name a stage of this pipeline",
            "FieldValueInvalid",
        ),
        *_per_pipeline(
            _input_earlier_rule,
            "inputs must name earlier stages: the stage graph may not have cycles",
            "FieldValueInvalid",
        ),
        *_on_roles(
            "has(s.acceleration)",
            frozenset({Role.DENOISER}),
            "acceleration (step caching, CFG-parallel, quantization) applies to a denoiser stage",
        ),
        *_on_roles(
            "has(s.autoscaling) && has(s.autoscaling.metric) && "
            f"s.autoscaling.metric == {json.dumps(Metric.FIRST_AUDIO_P90.value)}",
            AUDIO_ROLES,
            "autoscaling.metric first-audio-p90 is timed by a talker or code2wav stage",
        ),
        *_adapters_on_denoisers(),
        *_thinker_adapters_whole(),
    ]


ROOT_RULES: list[Schema] = [
    {
        "rule": f"self.metadata.name.matches({json.dumps(c.DNS_LABEL_PATTERN)}) && "
        f"size(self.metadata.name) <= {MAX_PIPELINE_NAME}",
        "message": f"metadata.name must be a DNS label (lowercase letters, digits, '-', starting "
        f"with a letter) of at most {MAX_PIPELINE_NAME} characters, so child names fit in 63",
    },
    {
        "rule": "!has(self.spec.stages) || "
        "self.spec.stages.all(s, size(self.metadata.name) + 1 + size(s.name) <= 63)",
        "message": "spec.stages[].name: <pipeline>-<stage> must be at most 63 characters",
    },
    {
        "rule": "!has(self.spec.adapters) || "
        "self.spec.adapters.all(a, a.name != self.metadata.name)",
        "message": "spec.adapters[].name: the pipeline's own name is its base model's id; "
        "name the adapter otherwise",
    },
]

ACCELERATION_RULES: list[Schema] = [
    {
        "rule": "!has(self.cache) || !has(self.cfgParallelSize) || self.cfgParallelSize == 1",
        "message": "cache and cfgParallelSize 2 do not combine: use one of them",
        "fieldPath": ".cfgParallelSize",
    },
]

STAGE_RULES: list[Schema] = [
    {
        "rule": "!has(self.acceleration) || !has(self.acceleration.cfgParallelSize) || "
        "self.acceleration.cfgParallelSize == 1 || !has(self.resources) || "
        "!has(self.resources.gpus) || self.resources.gpus != 1",
        "message": "acceleration.cfgParallelSize 2 needs two devices: resources.gpus of 2 or "
        "more, or none (the CPU)",
        "fieldPath": ".acceleration.cfgParallelSize",
    },
]

AUTOSCALING_RULES: list[Schema] = [
    {
        "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
        "message": "minReplicas must be <= maxReplicas",
        "fieldPath": ".minReplicas",
    },
    {
        "rule": "!has(self.metric) || self.metric != 'promql' || has(self.query)",
        "message": "query is required when metric is promql",
        "fieldPath": ".query",
    },
]
