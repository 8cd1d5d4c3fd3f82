"""Generate the OmniPipeline CustomResourceDefinition from the pydantic models: their
structural schema (api/crd_structural.py) with its list types and printer columns, and the
cross-field rules as CEL (api/crd_rules.py, api/crd_placement_rules.py).
"""

from __future__ import annotations

from omnipipe.api import constants as c
from omnipipe.api.crd_placement_rules import placement_rules
from omnipipe.api.crd_rules import (
    ACCELERATION_RULES,
    AUTOSCALING_RULES,
    ROOT_RULES,
    STAGE_RULES,
    stage_graph_rules,
)
from omnipipe.api.crd_structural import Schema, model_schema, require_descriptions
from omnipipe.api.families import pipeline_type_names
from omnipipe.api.spec import OmniPipelineSpec
from omnipipe.api.status import OmniPipelineStatus
from omnipipe.api.weights import weights_cel_rules
from omnipipe.api.yamlio import dump


def _spec_schema() -> Schema:
    spec = model_schema(OmniPipelineSpec)
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
    stage["properties"]["autoscaling"]["x-kubernetes-validations"] = AUTOSCALING_RULES
    stage["properties"]["acceleration"]["x-kubernetes-validations"] = ACCELERATION_RULES
    stage["x-kubernetes-validations"] = STAGE_RULES
    spec["x-kubernetes-validations"] = [*stage_graph_rules(), *placement_rules()]
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
    status = model_schema(OmniPipelineStatus)
    props = status["properties"]
    for key, field in (("conditions", "type"), ("stages", "name"), ("revisions", "revision")):
        props[key]["x-kubernetes-list-type"] = "map"
        props[key]["x-kubernetes-list-map-keys"] = [field]
    return status


def build_crd() -> Schema:
    """The OmniPipeline CRD as a dict, ready to dump as YAML."""
    spec, status = _spec_schema(), _status_schema()
    require_descriptions(spec, "spec")
    require_descriptions(status, "status")
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
        "x-kubernetes-validations": ROOT_RULES,
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
                    # What `kubectl get omnip` shows: what it serves, whether it is
                    # ready and, when not, why; the revisions with -o wide.
                    "additionalPrinterColumns": [
                        {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
                        {"name": "Stages", "type": "string", "jsonPath": ".status.stagesReady"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {
                            "name": "Reason",
                            "type": "string",
                            "description": "Why the pipeline is or is not ready",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
                        },
                        {
                            "name": "Progressing",
                            "type": "string",
                            "priority": 1,
                            "jsonPath": '.status.conditions[?(@.type=="Progressing")].status',
                        },
                        {
                            "name": "Current",
                            "type": "string",
                            "priority": 1,
                            "description": "The revision serving requests",
                            "jsonPath": ".status.currentRevision",
                        },
                        {
                            "name": "Update",
                            "type": "string",
                            "priority": 1,
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
