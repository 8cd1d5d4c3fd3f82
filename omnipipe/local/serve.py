"""`omnipipe serve`: start everything, wait for it, and stop it on a signal."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

from omnipipe.api import ResolvedPipeline
from omnipipe.api.placement import workloads
from omnipipe.local.reload import workload_replicas
from omnipipe.local.rollout import Loader
from omnipipe.local.supervisor import Supervisor


def serve(
    pipeline: ResolvedPipeline,
    pipeline_file: Path,
    host: str,
    port: int,
    ready_timeout: float,
    load: Loader | None = None,
) -> int:
    """Run the pipeline until SIGINT/SIGTERM. With `load`, SIGHUP reloads pipeline_file
    through it (it raises ManifestError for a file it cannot serve)."""
    sup = Supervisor(pipeline, pipeline_file, host, port, load=load, ready_timeout=ready_timeout)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    def on_hangup(signum: int, _frame: FrameType | None) -> None:
        sup.reload_requested = True

    # Installed explicitly: a shell without job control starts background jobs with
    # SIGINT ignored, and Python keeps an inherited "ignore".
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Before anything starts: SIGHUP's default would end us. One that comes while
    # starting is applied once all is ready.
    signal.signal(signal.SIGHUP, on_hangup)
    kinds = workloads(pipeline)
    workers = sum(workload_replicas(pipeline, w) for w in kinds)
    grouped = [f"{w.name}: {', '.join(w.stages)}" for w in kinds if w.colocated]
    together = f" (in one process: {'; '.join(grouped)})" if grouped else ""
    print(
        f"omnipipe: serving {pipeline.name} ({pipeline.pipeline}, model {pipeline.model}, "
        f"revision {sup.revision}): {workers} worker(s) for {len(pipeline.stages)} "
        f"stage(s){together} + router",
        flush=True,
    )
    try:
        sup.start()
        sup.wait_ready(ready_timeout)
        sup.wait_router_routes_every_worker()
        reload_hint = f"; kill -HUP {os.getpid()} to reload the file" if load else ""
        print(
            f"omnipipe: ready. OpenAI base URL: http://{host}:{port}/v1  "
            f"(model: {pipeline.name}; Ctrl-C to stop{reload_hint})",
            flush=True,
        )
        sup.run_forever()
    except KeyboardInterrupt:
        print("omnipipe: stopping", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"omnipipe: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        sup.stop()
    return 0
