"""The NetworkPolicy that admits traffic to a pipeline's stage pods, and nothing else:
its router pods to the control port, its stage pods to the transfer port, and the
configured metrics scrapers to the control port (workers serve /metrics there)."""

from __future__ import annotations

from omnipipe.api import constants as c
from omnipipe.api.names import (
    common_labels,
    router_selector,
    stage_network_policy_name,
    stages_selector,
)
from omnipipe.api.placement import workloads
from omnipipe.api.spec import TransferBackend
from omnipipe.operator.builders.common import Manifest, object_meta
from omnipipe.operator.builders.context import BuildContext


def _tcp(port: int) -> Manifest:
    return {"protocol": "TCP", "port": port}


def build_stage_network_policy(ctx: BuildContext) -> Manifest | None:
    if not ctx.stage_network_policy:
        return None
    from_stages: Manifest = {"from": [{"podSelector": {"matchLabels": stages_selector(ctx.name)}}]}
    if ctx.pipeline.transfer.backend == TransferBackend.TCP:
        # A colocated group listens on one transfer port per stage, from 8101 up.
        listeners = max(len(w.stages) for w in workloads(ctx.pipeline))
        port = _tcp(c.WORKER_TRANSFER_PORT)
        if listeners > 1:
            port["endPort"] = c.WORKER_TRANSFER_PORT + listeners - 1
        from_stages["ports"] = [port]
    # UCX: the rendezvous is the transfer port, but UCX's own transports (TCP lanes,
    # RDMA connection managers) open ports of their choosing, so stage peers get every
    # port. They are still only this pipeline's stage pods.
    ingress: list[Manifest] = [
        {
            "from": [{"podSelector": {"matchLabels": router_selector(ctx.name)}}],
            "ports": [_tcp(c.WORKER_CONTROL_PORT)],
        },
        from_stages,
    ]
    if ctx.metrics_scrape_from:
        ingress.append(
            {"from": list(ctx.metrics_scrape_from), "ports": [_tcp(c.WORKER_CONTROL_PORT)]}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            ctx, stage_network_policy_name(ctx.name), common_labels(ctx.name, c.COMPONENT_STAGE)
        ),
        "spec": {
            "podSelector": {"matchLabels": stages_selector(ctx.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
