"""A colocated group's Deployment (spec.placement): one pod template whose worker runs
every stage of the group in one process. Its pods carry the group's name as their stage
label, so each member's Service selects them (builders/stage.py: build_stage_service)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable

from omnipipe.api import ResolvedStage
from omnipipe.api import constants as c
from omnipipe.api.cpus import cores_of
from omnipipe.api.placement import Workload
from omnipipe.operator.builders.common import (
    Manifest,
    container_security_context,
    content_hash,
    pipeline_file_args,
)
from omnipipe.operator.builders.context import BuildContext
from omnipipe.operator.builders.stage import (
    GPU_RESOURCE,
    WRITABLE_ROOT_ENGINES,
    pod_spec,
    stage_config_hash,
    worker_deployment,
)

ANNOTATION_STAGES = "omnipipe.io/stages"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def _bytes(quantity: str) -> int:
    for suffixes in (_BINARY, _DECIMAL):
        for suffix, scale in suffixes.items():
            if quantity.endswith(suffix):
                return int(float(quantity.removesuffix(suffix)) * scale)
    return int(float(quantity))


def _resources(members: list[ResolvedStage]) -> Manifest:
    """The members' CPU and memory summed (each gets its share in the process); the GPUs
    the hungriest member asks for, shared by all."""
    amounts: dict[str, object] = {}
    cpus = [cores_of(m.cpu) for m in members if m.cpu is not None]
    if cpus:
        amounts["cpu"] = f"{round(sum(c for c in cpus if c) * 1000)}m"
    memory = [_bytes(m.memory) for m in members if m.memory is not None]
    if memory:
        amounts["memory"] = str(sum(memory))
    if gpus := max(m.gpus for m in members):
        amounts[GPU_RESOURCE] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _unique(items: Iterable[Manifest], key: str | None = "name") -> list[Manifest]:
    """Each item once, the first of a name (validation refused members that disagree)."""
    seen: dict[str, Manifest] = {}
    for item in items:
        seen.setdefault(item[key] if key else json.dumps(item, sort_keys=True), item)
    return list(seen.values())


def group_config_hash(ctx: BuildContext, members: list[ResolvedStage]) -> str:
    """A change to any member rolls the group: it is one process."""
    return content_hash([stage_config_hash(ctx, m) for m in members])


def _group_pod_spec(ctx: BuildContext, group: Workload, members: list[ResolvedStage]) -> Manifest:
    specs = [pod_spec(ctx, m) for m in members]
    containers = [s["containers"][0] for s in specs]
    pod = copy.deepcopy(specs[0])
    worker = pod["containers"][0]
    ports = ",".join(str(c.WORKER_TRANSFER_PORT + i) for i in range(len(members)))
    worker["args"] = [
        *pipeline_file_args("worker"),
        "--group",
        group.name,
        "--transfer-ports",
        ports,
    ]
    worker["ports"] = [
        {"name": "control", "containerPort": c.WORKER_CONTROL_PORT, "protocol": "TCP"},
        *(
            {
                "name": "transfer" if i == 0 else f"transfer-{i}",
                "containerPort": c.WORKER_TRANSFER_PORT + i,
                "protocol": "TCP",
            }
            for i in range(len(members))
        ),
    ]
    worker["env"] = _unique(e for w in containers for e in w["env"])
    worker["volumeMounts"] = _unique(m for w in containers for m in w["volumeMounts"])
    worker["securityContext"] = container_security_context(
        read_only_root=all(m.engine not in WRITABLE_ROOT_ENGINES for m in members)
    )
    worker.pop("resources", None)
    if resources := _resources(members):
        worker["resources"] = resources
    pod["volumes"] = _unique(v for s in specs for v in s["volumes"])
    selector = {k: v for s in specs for k, v in (s.get("nodeSelector") or {}).items()}
    if selector:
        pod["nodeSelector"] = selector
    tolerations = _unique((t for s in specs for t in s.get("tolerations") or ()), key=None)
    if tolerations:
        pod["tolerations"] = tolerations
    return pod


def build_group_deployment(ctx: BuildContext, group: Workload) -> Manifest:
    members = [ctx.pipeline.stage(s) for s in group.stages]
    stages = ",".join(group.stages)
    deployment = worker_deployment(
        ctx,
        group.name,
        _group_pod_spec(ctx, group, members),
        {c.ANNOTATION_CONFIG_HASH: group_config_hash(ctx, members), ANNOTATION_STAGES: stages},
        # A group has no autoscaler yet: validation refuses one on its stages.
        members[0].replicas,
    )
    deployment["metadata"]["annotations"] = {ANNOTATION_STAGES: stages}
    return deployment
