"""Generate the OmniPipeline CustomResourceDefinition from the pydantic models.

Pydantic's JSON schema is rewritten into a Kubernetes structural schema: references
inlined, optional fields un-nulled, free-form maps marked, and cross-field rules added as
CEL. Defaults are left out on purpose: the API server would persist them into the
user's object and a stage override would then override every default field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from omnipipe.api import constants as c
from omnipipe.api.adapters import ADAPTER_ROLES
from omnipipe.api.families import CUSTOM, pipeline_type_names, pipeline_types
from omnipipe.api.resource import MAX_PIPELINE_NAME
from omnipipe.api.roles import Engine, Role
from omnipipe.api.spec import OmniPipelineSpec
from omnipipe.api.status import OmniPipelineStatus
from omnipipe.api.weights import weights_cel_rules
from omnipipe.api.yamlio import dump

Schema = dict[str, Any]

_DROP = {"title", "default"}


def _cel_str_list(items: tuple[str, ...] | list[str]) -> str:
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
    d = _cel_str_list(defaults)
    return f"self.stages.all(s, s.name in {d} || (has(s.role) && has(s.engine)))"


def _input_exists_rule(defaults: tuple[str, ...]) -> str:
    d = _cel_str_list(defaults)
    return (
        f"self.stages.all(s, !has(s.inputs) || s.inputs.all(n, n in {d} || "
        "self.stages.exists(t, t.name == n)))"
    )


def _input_earlier_rule(defaults: tuple[str, ...]) -> str:
    """Stage order is the default stages first, then added stages in list order."""
    d = _cel_str_list(defaults)
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
    known = _cel_str_list(list(pipeline_types()))
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
    known = _cel_str_list(list(pipeline_types()))
    roles = _cel_str_list(sorted(r.value for r in ADAPTER_ROLES))
    typed = [
        (
            f"self.pipeline != {json.dumps(name)}",
            _cel_str_list([s.name for s in p.stages if s.role in ADAPTER_ROLES]),
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
        names = _cel_str_list(thinkers)
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


def _acceleration_on_denoisers() -> list[Schema]:
    """acceleration only on a denoiser stage: its own role, or its type's default role for
    a stage it names; one rule per type, as _per_pipeline's."""
    known = _cel_str_list(list(pipeline_types()))
    denoisers = [
        (
            f"self.pipeline != {json.dumps(name)}",
            [s.name for s in p.stages if s.role is Role.DENOISER],
        )
        for name, p in pipeline_types().items()
    ]
    denoisers.append((f"self.pipeline in {known}", []))
    return [
        {
            "rule": f"{skip} || !has(self.stages) || self.stages.all(s, "
            "!has(s.acceleration) || "
            f"(has(s.role) ? s.role == {json.dumps(Role.DENOISER.value)} : "
            f"s.name in {_cel_str_list(names)}))",
            "message": "acceleration (step caching, CFG-parallel, quantization) applies to a "
            "denoiser stage",
            "fieldPath": ".stages",
            "reason": "FieldValueInvalid",
        }
        for skip, names in denoisers
    ]


def _spec_rules() -> list[Schema]:
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
        *_acceleration_on_denoisers(),
        *_adapters_on_denoisers(),
        *_thinker_adapters_whole(),
        *_PLACEMENT_RULES,
        *_placement_per_pipeline(),
    ]


_GROUPS = "!has(self.placement) || !has(self.placement.groups) || self.placement.groups.all"
_COLOCATED = "has(self.placement) && has(self.placement.mode) && self.placement.mode == 'colocated'"


def _placement_per_pipeline() -> list[Schema]:
    """The placement rules that depend on a pipeline type's default stages (names and
    engines); one rule per type, as _per_pipeline's."""
    known = _cel_str_list(list(pipeline_types()))
    typed = [
        (
            f"self.pipeline != {json.dumps(name)}",
            p.stage_names,
            tuple(st.name for st in p.stages if st.engine is Engine.VLLM),
        )
        for name, p in pipeline_types().items()
    ]
    typed.append((f"self.pipeline in {known}", (), ()))
    rules: list[Schema] = []
    for skip, defaults, on_vllm in typed:
        d, v = _cel_str_list(defaults), _cel_str_list(on_vllm)
        given = "has(self.stages) && self.stages.exists(t, t.name == n && has(t.engine))"
        vllm = (
            f"(({given}) ? self.stages.exists(t, t.name == n && has(t.engine) && "
            f"t.engine == 'vllm') : n in {v})"
        )
        added_vllm = (
            f"(has(self.stages) ? self.stages.filter(t, !(t.name in {d}) && has(t.engine) "
            "&& t.engine == 'vllm').size() : 0)"
        )
        whole = "!has(self.placement.groups) || size(self.placement.groups) == 0 || " + (
            "(size(self.placement.groups) == 1 && !has(self.placement.groups[0].stages))"
        )
        rules += [
            {
                "rule": f"{skip} || {_GROUPS}(g, !has(g.stages) || g.stages.all(n, "
                f"n in {d} || (has(self.stages) && self.stages.exists(t, t.name == n))))",
                "message": "every stage of a group must be a stage of this pipeline",
                "fieldPath": ".placement.groups",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"{skip} || {_GROUPS}(g, !(g.name in {d}) && "
                "!(has(self.stages) && self.stages.exists(t, t.name == g.name)))",
                "message": "a group needs a name of its own, not a stage's",
                "fieldPath": ".placement.groups",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"{skip} || !({_COLOCATED}) || (({whole}) ? "
                f"{d}.filter(n, {vllm}).size() + {added_vllm} <= 1 : "
                f"self.placement.groups.all(g, !has(g.stages) || "
                f"g.stages.filter(n, {vllm}).size() <= 1))",
                "message": "a group's process holds one vLLM engine: at most one of its "
                "stages runs on vLLM",
                "fieldPath": ".placement",
                "reason": "FieldValueInvalid",
            },
        ]
    return rules


_PLACEMENT_RULES: list[Schema] = [
    {
        "rule": f"{_GROUPS}(g, !has(g.stages) || g.stages.all(n, "
        "self.placement.groups.exists_one(h, has(h.stages) && n in h.stages)))",
        "message": "a stage runs in one process: it may be in one group only",
        "fieldPath": ".placement.groups",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": f"!({_COLOCATED}) || !has(self.stages) || self.stages.all(t, "
        "!(has(t.replicas) || has(t.autoscaling)) || (has(self.placement.groups) && "
        "size(self.placement.groups) > 0 && !self.placement.groups.exists(g, "
        "!has(g.stages) || t.name in g.stages)))",
        "message": "a stage in a colocated group scales with it: set replicas on its "
        "group (spec.placement.groups)",
        "fieldPath": ".stages",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.placement) || !has(self.placement.groups) || "
        "size(self.placement.groups) == 0 || "
        "(has(self.placement.mode) && self.placement.mode == 'colocated')",
        "message": "groups need mode colocated",
        "fieldPath": ".placement.groups",
        "reason": "FieldValueInvalid",
    },
    {
        # Changing it moves stages between Deployments that the stages' Services
        # select by name; a rollout that keeps the old ones serving meanwhile is to come.
        "rule": "(has(self.placement) && has(self.placement.mode) ? self.placement.mode : "
        "'disaggregated') == (has(oldSelf.placement) && has(oldSelf.placement.mode) ? "
        "oldSelf.placement.mode : 'disaggregated') && (has(self.placement) && "
        "has(self.placement.groups) ? self.placement.groups : []).map(g, g.name) == "
        "(has(oldSelf.placement) && has(oldSelf.placement.groups) ? "
        "oldSelf.placement.groups : []).map(g, g.name) && (has(self.placement) && "
        "has(self.placement.groups) ? self.placement.groups : []).map(g, has(g.stages) ? "
        "g.stages : []) == (has(oldSelf.placement) && has(oldSelf.placement.groups) ? "
        "oldSelf.placement.groups : []).map(g, has(g.stages) ? g.stages : [])",
        "message": "spec.placement cannot change on a running pipeline (but a group's "
        "replicas): delete and re-create it",
        "fieldPath": ".placement",
        "reason": "FieldValueForbidden",
    },
]


_ROOT_RULES: list[Schema] = [
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

_ACCELERATION_RULES: list[Schema] = [
    {
        "rule": "!has(self.cache) || !has(self.cfgParallelSize) || self.cfgParallelSize == 1",
        "message": "cache and cfgParallelSize 2 do not combine: use one of them",
        "fieldPath": ".cfgParallelSize",
    },
]

_STAGE_RULES: list[Schema] = [
    {
        "rule": "!has(self.acceleration) || !has(self.acceleration.cfgParallelSize) || "
        "self.acceleration.cfgParallelSize == 1 || !has(self.resources) || "
        "!has(self.resources.gpus) || self.resources.gpus != 1",
        "message": "acceleration.cfgParallelSize 2 needs two devices: resources.gpus of 2 or "
        "more, or none (the CPU)",
        "fieldPath": ".acceleration.cfgParallelSize",
    },
]

_AUTOSCALING_RULES: list[Schema] = [
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


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Rewrite one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = {**target, **node}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        types = {o.get("type") for o in options}
        if types == {"string", "integer"}:
            # Quantities, written the way controller-gen writes resource.Quantity.
            pattern = next(o.get("pattern") for o in options if o.get("type") == "string")
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            node["x-kubernetes-int-or-string"] = True
            if pattern:
                node["pattern"] = pattern
            return {k: v for k, v in node.items() if k not in _DROP}
        elif len(options) == 1:
            node = {**options[0], **node}
        else:
            raise ValueError(f"cannot express union in a structural schema: {options}")
        return _structural(node, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:
                out[key] = _structural(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            # JSON Schema's number form; OpenAPI v3 (and the API server) want a bool.
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "description":
            out[key] = " ".join(value.split())
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _model_schema(model: type[OmniPipelineSpec] | type[OmniPipelineStatus]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def _walk(node: Schema, path: str, visit: Any) -> None:
    visit(node, path)
    for name, child in node.get("properties", {}).items():
        _walk(child, f"{path}.{name}", visit)
    if "items" in node:
        _walk(node["items"], f"{path}[]", visit)
    if isinstance(node.get("additionalProperties"), dict):
        _walk(node["additionalProperties"], f"{path}{{}}", visit)


def _require_descriptions(schema: Schema, root: str) -> None:
    missing: list[str] = []

    def visit(node: Schema, path: str) -> None:
        if not node.get("description") and not path.endswith(("[]", "}")):
            missing.append(path)

    _walk(schema, root, visit)
    if missing:
        raise ValueError(f"fields without a description: {', '.join(missing)}")


def _spec_schema() -> Schema:
    spec = _model_schema(OmniPipelineSpec)
    props = spec["properties"]
    props["pipeline"]["enum"] = list(pipeline_type_names())
    props["pipeline"].pop("pattern", None)
    stages = props["stages"]
    stages["x-kubernetes-list-type"] = "map"
    stages["x-kubernetes-list-map-keys"] = ["name"]
    stage = stages["items"]
    stage["properties"]["inputs"]["x-kubernetes-list-type"] = "set"
    stage["properties"]["env"]["x-kubernetes-list-type"] = "map"
    stage["properties"]["env"]["x-kubernetes-list-map-keys"] = ["name"]
    stage["properties"]["autoscaling"]["x-kubernetes-validations"] = _AUTOSCALING_RULES
    stage["properties"]["acceleration"]["x-kubernetes-validations"] = _ACCELERATION_RULES
    stage["x-kubernetes-validations"] = _STAGE_RULES
    spec["x-kubernetes-validations"] = _spec_rules()
    props["adapters"]["x-kubernetes-list-type"] = "map"
    props["adapters"]["x-kubernetes-list-map-keys"] = ["name"]
    props["weights"]["x-kubernetes-validations"] = weights_cel_rules()
    props["weights"]["properties"]["accessModes"]["x-kubernetes-list-type"] = "set"
    groups = props["placement"]["properties"]["groups"]
    groups["x-kubernetes-list-type"] = "map"
    groups["x-kubernetes-list-map-keys"] = ["name"]
    groups["items"]["properties"]["stages"]["x-kubernetes-list-type"] = "set"
    return spec


def _status_schema() -> Schema:
    status = _model_schema(OmniPipelineStatus)
    props = status["properties"]
    for key, field in (("conditions", "type"), ("stages", "name"), ("revisions", "revision")):
        props[key]["x-kubernetes-list-type"] = "map"
        props[key]["x-kubernetes-list-map-keys"] = [field]
    return status


def build_crd() -> Schema:
    """The OmniPipeline CRD as a dict, ready to dump as YAML."""
    spec, status = _spec_schema(), _status_schema()
    _require_descriptions(spec, "spec")
    _require_descriptions(status, "status")
    schema: Schema = {
        "type": "object",
        "description": "OmniPipeline serves one omni-modality model as a graph of stages "
        "(AR, diffusion, codec), each a Deployment scaled on its own, behind an "
        "OpenAI-compatible router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "omnipipe.io/v1alpha1"},
            "kind": {"type": "string", "description": "OmniPipeline"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": _ROOT_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{c.PLURAL}.{c.GROUP}"},
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "listKind": f"{c.KIND}List",
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": ["omnipipe"],
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {"name": "Stages", "type": "string", "jsonPath": ".status.stagesReady"},
                        {
                            "name": "Progressing",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Progressing")].status',
                        },
                        {
                            "name": "Current",
                            "type": "string",
                            "description": "The revision serving requests",
                            "jsonPath": ".status.currentRevision",
                        },
                        {
                            "name": "Update",
                            "type": "string",
                            "description": "The revision the spec asks for",
                            "jsonPath": ".status.updateRevision",
                        },
                        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `omnipipe crd` from omnipipe/api. Do not edit; run `make manifests`.\n"
    return header + dump(build_crd())
