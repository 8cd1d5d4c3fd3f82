"""Where a stage's replicas are: a static list (local mode) or the stage's headless
Service in DNS (Kubernetes), which resolves to ready pods only."""

from __future__ import annotations

import asyncio
import logging
import socket
from abc import ABC, abstractmethod
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api import constants as c
from omnipipe.api.loading import load_pipeline
from omnipipe.api.names import stage_object_name
from omnipipe.api.placement import control_path, workload_of
from omnipipe.api.resource import ManifestError
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import StaticReplicas

log = logging.getLogger(__name__)


class Discovery(ABC):
    @abstractmethod
    async def endpoints(self, stage: str) -> list[str]:
        """Control-API base URLs of the stage's replicas."""

    async def refresh(self) -> None:
        """Called before each round of endpoints(): pick up a changed source."""
        return None  # the DNS answer is fresh on every call already

    def preferred_revision(self) -> str | None:
        """The revision the source says is newest, if it says (see StaticReplicas)."""
        return None

    def generation(self) -> int:
        """Which version of the source the last refresh() read (0 when it has none)."""
        return 0

    def preferred_pipeline(self) -> ResolvedPipeline | None:
        """The resolved pipeline of preferred_revision(), if the source names one."""
        return None


def _revision_pipeline(replicas: StaticReplicas) -> ResolvedPipeline | None:
    """The pipeline file a replicas file names, checked against the revision it names:
    ManifestError when it cannot be read or is not that revision."""
    if not replicas.pipeline_file:
        return None
    pipeline = load_pipeline(replicas.pipeline_file)
    if replicas.revision and pipeline_revision(pipeline) != replicas.revision:
        raise ManifestError(
            f"{replicas.pipeline_file} is revision {pipeline_revision(pipeline)}, "
            f"not {replicas.revision}"
        )
    return pipeline


class StaticDiscovery(Discovery):
    """A fixed list, or a replicas file that is read again whenever it changes (local
    mode: `omnipipe serve` rewrites it on a reload, always by an atomic rename)."""

    def __init__(
        self, replicas: StaticReplicas | dict[str, list[str]], path: Path | None = None
    ) -> None:
        self._replicas = (
            replicas if isinstance(replicas, StaticReplicas) else StaticReplicas(stages=replicas)
        )
        self._path = path
        self._seen = self._stamp()
        self._pipeline = _revision_pipeline(self._replicas)

    def _stamp(self) -> tuple[int, int] | None:
        if self._path is None:
            return None
        st = self._path.stat()
        return st.st_mtime_ns, st.st_ino

    @classmethod
    def from_file(cls, path: str) -> StaticDiscovery:
        p = Path(path)
        return cls(StaticReplicas.parse(p.read_text()), p)

    async def refresh(self) -> None:
        if self._path is None:
            return
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return
            replicas = StaticReplicas.parse(self._path.read_text())
            pipeline = (
                self._pipeline
                if (replicas.pipeline_file, replicas.revision)
                == (self._replicas.pipeline_file, self._replicas.revision)
                else _revision_pipeline(replicas)
            )
        except (OSError, ValueError, ManifestError) as exc:
            # Keep routing on what we know; the next refresh tries again.
            log.warning("replicas file %s unreadable, keeping the last one: %s", self._path, exc)
            return
        self._replicas, self._seen, self._pipeline = replicas, stamp, pipeline
        log.info(
            "replicas file generation %d: revision %s, %s",
            replicas.generation,
            replicas.revision or "-",
            ", ".join(f"{s} x{len(u)}" for s, u in replicas.stages.items()),
        )

    async def endpoints(self, stage: str) -> list[str]:
        return list(self._replicas.stages.get(stage, []))

    def preferred_revision(self) -> str | None:
        return self._replicas.revision or None

    def generation(self) -> int:
        return self._replicas.generation

    def preferred_pipeline(self) -> ResolvedPipeline | None:
        return self._pipeline


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
        # A colocated stage's API sits under its group's root (/stages/<stage>).
        path = control_path(workload_of(self._pipeline, stage), stage)
        return [
            f"http://[{ip}]:{c.WORKER_CONTROL_PORT}{path}"
            if ":" in ip
            else f"http://{ip}:{c.WORKER_CONTROL_PORT}{path}"
            for ip in ips
        ]
