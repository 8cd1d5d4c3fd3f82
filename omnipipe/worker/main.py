"""`omnipipe worker`: load one stage and serve its control API."""

from __future__ import annotations

import logging

import uvicorn

from omnipipe.api.loading import load_pipeline
from omnipipe.worker.server import build_app
from omnipipe.worker.settings import WorkerSettings


def _quiet_progress_bars() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def run_worker(settings: WorkerSettings) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [{settings.stage}] %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _quiet_progress_bars()
    pipeline = load_pipeline(settings.pipeline_file)
    app = build_app(pipeline, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=int(settings.drain_timeout_seconds),
        )
    )
    state = app.state.worker
    # Not a SIGTERM to itself: uvicorn re-raises a signal it caught once it has shut
    # down, and PID 1 in a container ignores it, so the process ended with status 0.
    state.stop = lambda: setattr(server, "should_exit", True)
    server.run()
    if error := state.load_error:
        # A stage that could not load ends the process as a failure: Kubernetes then
        # reports an Error and CrashLoopBackOff, not a container that Completed.
        raise SystemExit(f"omnipipe worker: stage {settings.stage}: {error}")
