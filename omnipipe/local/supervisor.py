"""Start the router and every stage's workers as child processes with static discovery,
show readiness progress, and take them all down together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import CREDENTIAL_ENV, VIDEO_STORE_ENV
from omnipipe.api.cpus import split_cores, usable_cpus
from omnipipe.api.loading import pipeline_yaml
from omnipipe.api.placement import Workload, workloads
from omnipipe.api.resource import ManifestError
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import StaticReplicas
from omnipipe.local import control
from omnipipe.local.adapters import push_adapters, restore_adapters
from omnipipe.local.children import Child, die_with_parent, pipeline_credential
from omnipipe.local.ports import check_port_free, free_port
from omnipipe.local.reload import ReloadPlan, plan_reload, workload_replicas
from omnipipe.local.video_store import needs_video_store, start_redis

STOP_GRACE_SECONDS = 15.0


RESTART_WINDOW_SECONDS = 60.0
MAX_RESTARTS_IN_WINDOW = 5
# The local router re-reads its replicas file this often, unless told otherwise: a
# reload waits for it twice.
ROUTER_DISCOVERY_SECONDS = "1"
# torch puts large CPU tensors in transparent huge pages, which UCX's CMA copies between
# two processes twice as fast (as the worker image's ENV does; the user's env wins).
TORCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
ROUTER_SWITCH_TIMEOUT = 60.0

Loader = Callable[[Path], ResolvedPipeline]


class ReloadFailed(Exception):
    """A reload gave up; the running revision keeps serving."""


@dataclass
class Supervisor:
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

    @property
    def revision(self) -> str:
        return pipeline_revision(self.pipeline)

    def _free_port(self) -> int:
        port = free_port(self.host, avoid=self.ports_given | {self.port})
        self.ports_given.add(port)
        return port

    @property
    def replicas_file(self) -> Path:
        return self.state_dir / "replicas.json"

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.stage is not None]

    def _popen(
        self, argv: list[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            # In the environment, not argv: other users can read a process's arguments.
            env={
                **TORCH_ENV,
                **(extra_env or {}),
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                CREDENTIAL_ENV: self.credential,
            },
            preexec_fn=die_with_parent,
            # Children take signals from us, not from a terminal's Ctrl-C to the group,
            # so they stop in order: drain first, then exit.
            start_new_session=True,
        )

    def _snapshot(self, pipeline: ResolvedPipeline) -> Path:
        """The resolved pipeline in a file of its own, as the operator's per-revision
        ConfigMap: a worker (re)started later reads what its revision was, whatever the
        user's file says by then."""
        self.snapshots += 1
        path = self.state_dir / f"pipeline-{pipeline_revision(pipeline)}-{self.snapshots}.yaml"
        path.write_text(pipeline_yaml(pipeline))
        return path

    def _threads_args(self, workload: Workload) -> list[str]:
        """The worker's share of this machine's CPUs, unless its stage sets resources.cpu.
        A colocated group is one process: it splits its share among its stages."""
        sharing = {
            w.name: workload_replicas(self.pipeline, w)
            for w in workloads(self.pipeline)
            if w.colocated or self.pipeline.stage(w.name).cpu is None
        }
        threads = split_cores(usable_cpus(), sharing).get(workload.name)
        return [] if threads is None else ["--threads", str(threads)]

    def _spawn_worker(
        self, workload: Workload, snapshot: Path, revision: str, pending: bool
    ) -> Child:
        name = workload.name
        index = self.started_per_stage.get(name, 0)
        self.started_per_stage[name] = index + 1
        control_port = self._free_port()
        transfer = ",".join(str(self._free_port()) for _ in workload.stages)
        url = f"http://{self.host}:{control_port}"
        runs = (
            ["--group", name, "--transfer-ports", transfer]
            if workload.colocated
            else ["--stage", name, "--transfer-port", transfer]
        )
        argv = [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "worker",
            "--pipeline",
            str(snapshot),
            *runs,
            "--host",
            self.host,
            "--port",
            str(control_port),
            "--advertise-host",
            self.host,
            *self._threads_args(workload),
        ]
        child = Child(
            f"{name}-{index}",
            self._popen(argv),
            f"{url}/ready",
            argv,
            restartable=True,
            stage=name,
            revision=revision,
            pending=pending,
            members=workload.stages,
            colocated=workload.colocated,
        )
        self.children.append(child)
        return child

    def _write_replicas(self, routed: list[Child], revision: str) -> int:
        """Atomically: the router never reads half a file."""
        self.generation += 1
        stages: dict[str, list[str]] = {s.name: [] for s in self.pipeline.stages}
        for child in routed:
            for stage in child.members:
                stages.setdefault(stage, []).append(child.stage_url(stage))
        body = StaticReplicas(
            stages=stages,
            revision=revision,
            generation=self.generation,
            pipeline_file=str(self.snapshot or ""),
        )
        tmp = self.replicas_file.with_suffix(".tmp")
        tmp.write_text(body.model_dump_json())
        tmp.replace(self.replicas_file)
        return self.generation

    def start(self) -> None:
        try:
            # Before any worker starts: a router that cannot bind fails only after them.
            check_port_free(self.host, self.port)
        except OSError as exc:
            raise RuntimeError(str(exc)) from None
        snapshot = self.snapshot = self._snapshot(self.pipeline)
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
                f"omnipipe: video jobs kept in {env[VIDEO_STORE_ENV]} (redis-server, pid "
                f"{self.video_store.pid}; {VIDEO_STORE_ENV} names another)",
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

    def _check_alive(self) -> None:
        store = self.video_store
        if store is not None and not self.stopping and (code := store.poll()) is not None:
            # Its jobs went with it: serve stops, as it does when its router dies, rather
            # than answer 503 for ever.
            raise RuntimeError(f"the video job store (redis-server) exited with code {code}")
        for child in self.children:
            code = child.proc.poll()
            if code is None or self.stopping or child.pending:
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_SECONDS]
            if not child.restartable or len(child.restarts) >= MAX_RESTARTS_IN_WINDOW:
                raise RuntimeError(f"{child.name} exited with code {code}")
            child.restarts.append(now)
            for flag in ("--transfer-port", "--transfer-ports"):
                if flag in child.argv:
                    # UCX cannot rebind a port its predecessor just held; the router
                    # learns the new transfer address from the worker's /ready.
                    at = child.argv.index(flag) + 1
                    count = len(child.argv[at].split(","))
                    child.argv[at] = ",".join(str(self._free_port()) for _ in range(count))
            child.proc = self._popen(child.argv)
            print(
                f"omnipipe: {child.name} exited with code {code}; restarting as pid "
                f"{child.proc.pid} ({len(child.restarts)}/{MAX_RESTARTS_IN_WINDOW} in "
                f"{RESTART_WINDOW_SECONDS:.0f}s)",
                flush=True,
            )

    def wait_ready(self, timeout: float, children: list[Child] | None = None) -> None:
        """Until every one of `children` (all, by default) answers /ready. A pending
        child that exits fails the wait at once (ReloadFailed)."""
        group = self.children if children is None else children
        deadline = time.monotonic() + timeout
        shown: set[str] = set()
        total = len(group)
        while time.monotonic() < deadline:
            self._check_alive()
            for child in group:
                if child.pending and (code := child.proc.poll()) is not None:
                    raise ReloadFailed(f"{child.name} exited with code {code} while starting")
                if child.name not in shown and control.is_ready(child.ready_url, child.stage):
                    shown.add(child.name)
                    of = f", revision {child.revision}" if child.revision else ""
                    print(
                        f"  [{len(shown)}/{total}] {child.name} ready at {child.url} "
                        f"(pid {child.proc.pid}){of}",
                        flush=True,
                    )
            if len(shown) == total:
                return
            time.sleep(0.25)
        waiting = [c.name for c in group if c.name not in shown]
        message = f"not ready after {timeout:.0f}s: {', '.join(waiting)}"
        if children is not None:
            raise ReloadFailed(message)
        raise RuntimeError(message)

    def _wait_router(self, generation: int, revision: str | None) -> None:
        """Until the router has applied this replicas-file generation (and, when given,
        starts new requests on that revision)."""
        deadline = time.monotonic() + ROUTER_SWITCH_TIMEOUT
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            seen = control.router_state(f"http://{self.host}:{self.port}/ready")
            applied = seen.get("discovery")
            if (
                isinstance(applied, int)
                and applied >= generation
                and (revision is None or seen.get("revision") == revision)
            ):
                return
            time.sleep(0.2)
        raise ReloadFailed(
            f"the router did not take replicas generation {generation} "
            f"(revision {revision or '-'}) within {ROUTER_SWITCH_TIMEOUT:.0f}s: {seen}"
        )

    def _retire(self, old: list[Child]) -> None:
        """Drain (in-flight requests finish), then stop; the router no longer knows them."""
        for child, answer in zip(
            old, control.drain_all([c.url for c in old], self.credential), strict=True
        ):
            print(f"  {child.name} drained: {answer}", flush=True)
        self._terminate(old)
        self.children = [c for c in self.children if c not in old]

    def _terminate(self, children: list[Child]) -> None:
        for child in children:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def reload(self) -> None:
        """SIGHUP: apply the file as it is now, the way the operator rolls out a change.
        Whatever goes wrong, the running revision keeps serving."""
        assert self.load is not None
        print(f"omnipipe: SIGHUP: reloading {self.pipeline_file}", flush=True)
        try:
            new = self.load(self.pipeline_file)
        except ManifestError as exc:
            print(
                f"omnipipe: reload failed, still serving revision {self.revision}: {exc}",
                flush=True,
            )
            return
        plan = plan_reload(self.pipeline, new)
        if plan.refused:
            print(
                f"omnipipe: reload refused, still serving revision {self.revision}: {plan.refused}",
                flush=True,
            )
            return
        if not plan.changes_anything:
            print(f"omnipipe: no change; serving revision {self.revision}", flush=True)
            return
        try:
            self._roll(new, plan)
        except ReloadFailed as exc:
            print(
                f"omnipipe: reload failed, still serving revision {self.revision}: {exc}",
                flush=True,
            )

    def _roll(self, new: ResolvedPipeline, plan: ReloadPlan) -> None:
        rev = plan.new_revision
        if plan.new_revision_rolls_out:
            print(
                f"omnipipe: rolling out revision {rev} beside revision {plan.old_revision}: "
                "starting its workers",
                flush=True,
            )
        snapshot = self._snapshot(new)
        started: list[Child] = []
        retiring: list[Child] = []
        for workload in workloads(new):
            mine = [c for c in self.workers if c.stage == workload.name]
            # A group is one process: a change to any of its stages replaces it.
            if any(s in plan.replace for s in workload.stages):
                started += [
                    self._spawn_worker(workload, snapshot, rev, pending=True)
                    for _ in range(workload_replicas(new, workload))
                ]
                retiring += mine
                continue
            now, want = plan.counts[workload.stages[0]]
            started += [
                self._spawn_worker(workload, snapshot, rev, pending=True) for _ in range(want - now)
            ]
            retiring += mine[want:]
        try:
            self.wait_ready(self.ready_timeout, started)
        except ReloadFailed:
            self._terminate(started)
            self.children = [c for c in self.children if c not in started]
            raise
        for child in started:
            child.pending = False
        keep = [c for c in self.workers if c not in retiring]
        if problem := push_adapters(plan.adapters, keep, self.credential):
            self._terminate(started)
            self.children = [c for c in self.children if c not in started]
            restore_adapters(plan.adapters, self.pipeline, keep, self.credential)
            raise ReloadFailed(problem)
        self.pipeline, self.snapshot = new, snapshot
        # Route to both, new requests starting on the new revision once the router has
        # seen it whole; then take the old ones out of the router, and only then drain
        # them: nothing new is sent to a worker that refuses work.
        self._wait_router(self._write_replicas(self.workers, rev), rev)
        if plan.new_revision_rolls_out:
            print(f"omnipipe: switched: new requests start on revision {rev}", flush=True)
        self._wait_router(self._write_replicas(keep, rev), None)
        if retiring:
            what = f"revision {plan.old_revision}" if plan.new_revision_rolls_out else "old"
            print(
                f"omnipipe: draining {len(retiring)} {what} worker(s): "
                f"{', '.join(c.name for c in retiring)}",
                flush=True,
            )
            self._retire(retiring)
        print(
            f"omnipipe: reloaded: serving revision {rev} with {len(self.workers)} worker(s)"
            f" (model: {new.name} or {new.model})",
            flush=True,
        )

    def stop(self) -> None:
        self.stopping = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._terminate(self.children)
        if self.video_store is not None:
            # After the router, which gives its running jobs back to the store.
            self.video_store.terminate()
            self.video_store.wait()

    def run_forever(self) -> None:
        while True:
            if self.reload_requested and self.load is not None:
                self.reload_requested = False
                self.reload()
            self._check_alive()
            time.sleep(0.5)
