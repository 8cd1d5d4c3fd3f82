"""Where a stage's replicas are: a static list (local mode) or the stage's headless
Service in DNS (Kubernetes), which resolves to ready pods only."""

from __future__ import annotations

import asyncio
import json
import socket
from abc import ABC, abstractmethod
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api import constants as c
from omnipipe.api.names import stage_object_name


class Discovery(ABC):
    @abstractmethod
    async def endpoints(self, stage: str) -> list[str]:
        """Control-API base URLs of the stage's replicas."""


class StaticDiscovery(Discovery):
    def __init__(self, replicas: dict[str, list[str]]) -> None:
        self._replicas = replicas

    @classmethod
    def from_file(cls, path: str) -> StaticDiscovery:
        data = json.loads(Path(path).read_text())
        return cls({str(k): [str(u) for u in v] for k, v in data.items()})

    async def endpoints(self, stage: str) -> list[str]:
        return list(self._replicas.get(stage, []))


class DnsDiscovery(Discovery):
    def __init__(self, pipeline: ResolvedPipeline, cluster_domain: str) -> None:
        self._pipeline = pipeline
        self._domain = cluster_domain

    async def endpoints(self, stage: str) -> list[str]:
        service = stage_object_name(self._pipeline.name, stage)
        host = f"{service}.{self._pipeline.namespace}.{self._domain}"
        try:
            infos = await asyncio.to_thread(
                socket.getaddrinfo, host, c.WORKER_CONTROL_PORT, type=socket.SOCK_STREAM
            )
        except socket.gaierror:
            return []
        ips = sorted({str(info[4][0]) for info in infos})
        return [
            f"http://[{ip}]:{c.WORKER_CONTROL_PORT}"
            if ":" in ip
            else f"http://{ip}:{c.WORKER_CONTROL_PORT}"
            for ip in ips
        ]
