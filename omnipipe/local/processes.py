"""The children of `omnipipe serve` as a group: starting a stage's worker, restarting one
that crashed, waiting until they answer /ready, and draining and stopping them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import CREDENTIAL_ENV
from omnipipe.api.cpus import split_cores, usable_cpus
from omnipipe.api.placement import Workload, workloads
from omnipipe.local import control
from omnipipe.local.children import Child, Process, die_with_parent
from omnipipe.local.forks import WorkerForks, reap_orphans
from omnipipe.local.ports import free_port
from omnipipe.local.reload import workload_replicas

STOP_GRACE_SECONDS = 15.0
RESTART_WINDOW_SECONDS = 60.0
MAX_RESTARTS_IN_WINDOW = 5
# torch puts large CPU tensors in transparent huge pages, which UCX's CMA copies between
# two processes twice as fast (as the worker image's ENV does; the user's env wins).
TORCH_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


class ReloadFailed(Exception):
    """A reload gave up; the running revision keeps serving."""


class ChildProcesses:
    """Mixed into Supervisor, which sets these."""

    pipeline: ResolvedPipeline
    host: str
    port: int
    children: list[Child]
    stopping: bool
    credential: str
    started_per_stage: dict[str, int]
    ports_given: set[int]
    video_store: subprocess.Popen[bytes] | None
    forks: WorkerForks

    def _free_port(self) -> int:
        port = free_port(self.host, avoid=self.ports_given | {self.port})
        self.ports_given.add(port)
        return port

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.stage is not None]

    def _child_env(self, extra_env: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **TORCH_ENV,
            **(extra_env or {}),
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # In the environment, not argv: other users can read a process's arguments.
            CREDENTIAL_ENV: self.credential,
        }

    def _start_worker(self, argv: list[str]) -> Process:
        """Forked from a fork server where one can take it (local/forks.py), else started."""
        forked = self.forks.start(argv, self._child_env())
        return forked if forked is not None else self._popen(argv)

    def _popen(
        self, argv: list[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            env=self._child_env(extra_env),
            preexec_fn=die_with_parent,
            # Children take signals from us, not from a terminal's Ctrl-C to the group,
            # so they stop in order: drain first, then exit.
            start_new_session=True,
        )

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
            self._start_worker(argv),
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

    def _prepare_forks(self, kinds: Sequence[Workload]) -> None:
        """Start the fork server of each thread budget these workloads' workers have, so
        that they import side by side, before the first worker waits for one."""
        budgets = set()
        for workload in kinds:
            args = self._threads_args(workload)
            if args and not workload.colocated:
                budgets.add(int(args[1]))
        self.forks.prepare(sorted(budgets), self._child_env())

    def _check_alive(self) -> None:
        # Processes adopted as the forked workers' subreaper: a crashed worker's children.
        known = {c.proc.pid for c in self.children} | self.forks.pids()
        reap_orphans(known | ({self.video_store.pid} if self.video_store else set()))
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
            child.proc = self._start_worker(child.argv)
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
