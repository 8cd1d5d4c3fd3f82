"""How `omnipipe serve` moves between revisions: each revision's resolved pipeline in a
file of its own, the replicas file the router routes by, and SIGHUP's reload, rolled out
beside the running revision as the operator rolls out a change (the plan is reload.py's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from omnipipe.api import ResolvedPipeline
from omnipipe.api.loading import pipeline_yaml
from omnipipe.api.placement import workloads
from omnipipe.api.resource import ManifestError
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import StaticReplicas
from omnipipe.local import control
from omnipipe.local.adapters import push_adapters, restore_adapters
from omnipipe.local.children import Child
from omnipipe.local.processes import ChildProcesses, ReloadFailed
from omnipipe.local.reload import ReloadPlan, plan_reload, workload_replicas

ROUTER_SWITCH_TIMEOUT = 60.0
# The router polls each replica every second (serve's ROUTER_DISCOVERY_SECONDS): a few
# polls' worth.
ROUTER_SEES_WORKERS_SECONDS = 10.0

Loader = Callable[[Path], ResolvedPipeline]


class RevisionReloads(ChildProcesses):
    """Mixed into Supervisor, which sets these."""

    pipeline_file: Path
    load: Loader | None
    ready_timeout: float
    state_dir: Path
    generation: int
    snapshots: int
    snapshot: Path | None

    @property
    def revision(self) -> str:
        return pipeline_revision(self.pipeline)

    @property
    def replicas_file(self) -> Path:
        return self.state_dir / "replicas.json"

    def _snapshot(self, pipeline: ResolvedPipeline) -> Path:
        """The resolved pipeline in a file of its own, as the operator's per-revision
        ConfigMap: a worker (re)started later reads what its revision was, whatever the
        user's file says by then."""
        self.snapshots += 1
        path = self.state_dir / f"pipeline-{pipeline_revision(pipeline)}-{self.snapshots}.yaml"
        path.write_text(pipeline_yaml(pipeline))
        return path

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

    def _router_until(
        self, done: Callable[[dict[str, object]], bool], timeout: float, every: float
    ) -> tuple[bool, dict[str, object]]:
        """Polls the router's /ready body until done(body) (True), or timeout (False);
        with the last body seen."""
        deadline = time.monotonic() + timeout
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            seen = control.router_state(f"http://{self.host}:{self.port}/ready")
            if done(seen):
                return True, seen
            time.sleep(every)
        return False, seen

    def _wait_router(self, generation: int, revision: str | None) -> None:
        """Until the router has applied this replicas-file generation (and, when given,
        starts new requests on that revision)."""

        def applied(seen: dict[str, object]) -> bool:
            taken = seen.get("discovery")
            return (
                isinstance(taken, int)
                and taken >= generation
                and (revision is None or seen.get("revision") == revision)
            )

        took, seen = self._router_until(applied, ROUTER_SWITCH_TIMEOUT, 0.2)
        if not took:
            raise ReloadFailed(
                f"the router did not take replicas generation {generation} "
                f"(revision {revision or '-'}) within {ROUTER_SWITCH_TIMEOUT:.0f}s: {seen}"
            )

    def wait_router_routes_every_worker(self, timeout: float = ROUTER_SEES_WORKERS_SECONDS) -> bool:
        """Until the router has found every started worker ready: it polls them on its own
        clock, so the first replica of a stage may be routed to a second before the rest,
        and requests sent at once would all go to it. False (and a line saying which)
        if it has not within `timeout`; the router routes to the rest once it does."""
        started: dict[str, int] = {}
        for child in self.workers:
            for stage in child.members:
                started[stage] = started.get(stage, 0) + 1

        def every_worker(seen: dict[str, object]) -> bool:
            routed = seen.get("replicas")
            return isinstance(routed, dict) and all(
                isinstance(routed.get(stage), int) and routed[stage] >= n
                for stage, n in started.items()
            )

        routed, seen = self._router_until(every_worker, timeout, 0.1)
        if not routed:
            print(
                f"omnipipe: the router does not route to every worker yet "
                f"({seen.get('replicas')} of {started} ready); it adds each once its poll "
                "finds it ready",
                flush=True,
            )
        return routed

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
