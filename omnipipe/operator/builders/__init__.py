"""Pure builders: BuildContext -> manifests. No I/O, no clock, no randomness."""

from omnipipe.api.placement import workloads
from omnipipe.operator.builders.common import Manifest
from omnipipe.operator.builders.configmap import build_config_map
from omnipipe.operator.builders.context import BuildContext, OwnerRef, build_context
from omnipipe.operator.builders.credential import build_credential_secret
from omnipipe.operator.builders.group import build_group_deployment
from omnipipe.operator.builders.network import build_stage_network_policy
from omnipipe.operator.builders.router import (
    build_router_deployment,
    build_router_service,
    router_endpoint,
)
from omnipipe.operator.builders.scaling import build_scaler
from omnipipe.operator.builders.stage import build_stage_deployment, build_stage_service
from omnipipe.operator.builders.weights import (
    build_weights_children,
    cached_models,
    fetch_job_for,
    waits_for_weights,
)


def build_children(ctx: BuildContext) -> list[Manifest]:
    """Every child of the pipeline, in apply order: config and model caches first, router
    last. (The credential Secret is not among them: it is created once, never applied
    again.) A stage whose weights are not cached yet has no Deployment (nor scaler)."""
    children = [build_config_map(ctx), *build_weights_children(ctx)]
    policy = build_stage_network_policy(ctx)
    if policy is not None:
        children.append(policy)
    for workload in workloads(ctx.pipeline):
        members = [ctx.pipeline.stage(s) for s in workload.stages]
        children.extend(build_stage_service(ctx, stage) for stage in members)
        if any(waits_for_weights(ctx, stage) for stage in members):
            continue
        if workload.colocated:
            children.append(build_group_deployment(ctx, workload))
            continue
        [stage] = members
        children.append(build_stage_deployment(ctx, stage))
        scaler = build_scaler(ctx, stage)
        if scaler is not None:
            children.append(scaler)
    children.append(build_router_service(ctx))
    children.append(build_router_deployment(ctx))
    return children


__all__ = [
    "BuildContext",
    "Manifest",
    "OwnerRef",
    "build_children",
    "build_context",
    "build_credential_secret",
    "cached_models",
    "fetch_job_for",
    "router_endpoint",
    "waits_for_weights",
]
