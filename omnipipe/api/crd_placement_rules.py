"""The CRD's CEL rules of spec.placement: the API server's copy of
pipelines._check_placement, so that `kubectl apply` refuses what `omnipipe serve` refuses.
"""

from __future__ import annotations

import json

from omnipipe.api.crd_rules import cel_str_list
from omnipipe.api.crd_structural import Schema
from omnipipe.api.families import pipeline_types
from omnipipe.api.roles import Engine

_GROUPS = "!has(self.placement) || !has(self.placement.groups) || self.placement.groups.all"
_COLOCATED = "has(self.placement) && has(self.placement.mode) && self.placement.mode == 'colocated'"


def placement_rules() -> list[Schema]:
    """spec's rules of its placement, in the order the CRD lists them."""
    return [*_FIXED_RULES, *_per_pipeline()]


def _per_pipeline() -> list[Schema]:
    """The placement rules that depend on a pipeline type's default stages (names and
    engines); one rule per type, as crd_rules._per_pipeline's."""
    known = cel_str_list(list(pipeline_types()))
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
        d, v = cel_str_list(defaults), cel_str_list(on_vllm)
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


_FIXED_RULES: list[Schema] = [
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
