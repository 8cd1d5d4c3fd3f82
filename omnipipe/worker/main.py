"""`omnipipe worker`: load one stage and serve its control API."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from omnipipe.api.constants import SERVER_KEEP_ALIVE_SECONDS
from omnipipe.api.loading import load_pipeline
from omnipipe.api.placement import workloads
from omnipipe.worker.group import build_group_app
from omnipipe.worker.server import WorkerState, build_app
from omnipipe.worker.settings import WorkerSettings
from omnipipe.worker.threads import group_budget, group_teams

# Kubernetes' default terminationMessagePath; its size limit is 4096 bytes.
TERMINATION_LOG = Path("/dev/termination-log")
MAX_TERMINATION_MESSAGE = 4000


def _quiet_progress_bars() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _build(settings: WorkerSettings) -> tuple[FastAPI, list[WorkerState]]:
    """The app, and the state of each stage it runs."""
    pipeline = load_pipeline(settings.pipeline_file)
    if not settings.group:
        app = build_app(pipeline, settings)
        return app, [app.state.worker]
    group = next(w for w in workloads(pipeline) if w.group == settings.group)
    ports = settings.transfer_ports or tuple(
        settings.transfer_port + i for i in range(len(group.stages))
    )
    total = group_budget(settings.threads)
    app = build_group_app(
        pipeline, settings, group, ports, group_teams(pipeline, group.stages, total)
    )
    return app, app.state.group


def run_worker(settings: WorkerSettings) -> None:
    name = settings.group or settings.stage
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _quiet_progress_bars()
    app, states = _build(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_keep_alive=SERVER_KEEP_ALIVE_SECONDS,
            timeout_graceful_shutdown=int(settings.drain_timeout_seconds),
        )
    )
    # Not a SIGTERM to itself: uvicorn re-raises a signal it caught once it has shut
    # down, and PID 1 in a container ignores it, so the process ended with status 0.
    # A stage of a group that cannot load ends the whole process: one failure domain.
    for state in states:
        state.stop = lambda: setattr(server, "should_exit", True)
    server.run()
    if failed := [f"stage {s.settings.stage}: {s.load_error}" for s in states if s.load_error]:
        # A stage that could not load ends the process as a failure: Kubernetes then
        # reports an Error and CrashLoopBackOff, not a container that Completed.
        group = f"group {settings.group}: " if settings.group else ""
        message = f"omnipipe worker: {group}{'; '.join(failed)}"
        report_termination(message)
        raise SystemExit(message)


def report_termination(message: str, path: Path = TERMINATION_LOG) -> None:
    """One line in the container's termination message (the file exists only in a
    container): the pod's status shows it, and the operator reads it into Stalled. A
    library's multi-line error would otherwise leave only its last line there."""
    if not path.exists():
        return
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    with contextlib.suppress(OSError):
        path.write_text(line[:MAX_TERMINATION_MESSAGE])
