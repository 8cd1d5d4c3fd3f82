"""Start the router and every stage's workers as child processes with static discovery,
show readiness progress, and take them all down together."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import VIDEO_STORE_ENV
from omnipipe.api.placement import workloads
from omnipipe.local.children import Child, pipeline_credential
from omnipipe.local.forks import WorkerForks
from omnipipe.local.ports import check_port_free
from omnipipe.local.reload import workload_replicas
from omnipipe.local.rollout import Loader, RevisionReloads
from omnipipe.local.video_store import needs_video_store, start_redis

# The local router re-reads its replicas file this often, unless told otherwise: a
# reload waits for it twice.
ROUTER_DISCOVERY_SECONDS = "1"


@dataclass
class Supervisor(RevisionReloads):
    """One `omnipipe serve`: its state, and what it does at start and stop. Running the
    children is ChildProcesses' (processes.py), a revision change RevisionReloads' (rollout.py)."""

    pipeline: ResolvedPipeline
    pipeline_file: Path
    host: str = "127.0.0.1"
    port: int = 8000
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    credential: str = field(default_factory=pipeline_credential, repr=False)
    load: Loader | None = None
    ready_timeout: float = 600.0
    state_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="omnipipe-")))
    reload_requested: bool = False
    generation: int = 0
    snapshots: int = 0
    started_per_stage: dict[str, int] = field(default_factory=dict)
    # The serving revision's snapshot: the replicas file names it, so that the router
    # answers for that revision's model.
    snapshot: Path | None = None
    # Every port handed to a child, and the router's: a child binds its ports a while
    # after they are picked, so the same free port could otherwise be picked twice.
    ports_given: set[int] = field(default_factory=set)
    # The redis-server a video pipeline's router keeps its jobs in, when serve started it.
    video_store: subprocess.Popen[bytes] | None = None
    forks: WorkerForks = field(default_factory=WorkerForks)

    def start(self) -> None:
        try:
            # Before any worker starts: a router that cannot bind fails only after them.
            check_port_free(self.host, self.port)
        except OSError as exc:
            raise RuntimeError(str(exc)) from None
        snapshot = self.snapshot = self._snapshot(self.pipeline)
        self._prepare_forks(workloads(self.pipeline))
        for workload in workloads(self.pipeline):
            for _ in range(workload_replicas(self.pipeline, workload)):
                self._spawn_worker(workload, snapshot, self.revision, pending=False)
        self._write_replicas(self.workers, self.revision)
        argv = [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "router",
            "--pipeline",
            str(snapshot),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--replicas-file",
            str(self.replicas_file),
        ]
        env = {"OMNIPIPE_ROUTER_DISCOVERY_INTERVAL_SECONDS": ROUTER_DISCOVERY_SECONDS}
        if needs_video_store(self.pipeline):
            self.video_store, env[VIDEO_STORE_ENV] = start_redis(self.state_dir / "video-store")
            print(
                f"omnipipe: video jobs and voices kept in {env[VIDEO_STORE_ENV]} (redis-server, "
                f"pid {self.video_store.pid}; {VIDEO_STORE_ENV} names another)",
                flush=True,
            )
        self.children.append(
            Child(
                "router",
                self._popen(argv, env),
                f"http://{self.host}:{self.port}/ready",
                argv,
                restartable=False,
            )
        )

    def stop(self) -> None:
        self.stopping = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._terminate(self.children)
        self.forks.close()
        if self.video_store is not None:
            # After the router, which gives its running jobs back to the store.
            self.video_store.terminate()
            self.video_store.wait()
        # Its snapshots, replicas file and video store were this run's alone.
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def run_forever(self) -> None:
        while True:
            if self.reload_requested and self.load is not None:
                self.reload_requested = False
                self.reload()
            self._check_alive()
            time.sleep(0.5)
