"""`omnipipe worker`: load one stage and serve its control API."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import uvicorn

from omnipipe.api.loading import load_pipeline
from omnipipe.worker.server import build_app
from omnipipe.worker.settings import WorkerSettings

# Kubernetes' default terminationMessagePath; its size limit is 4096 bytes.
TERMINATION_LOG = Path("/dev/termination-log")
MAX_TERMINATION_MESSAGE = 4000


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
        message = f"omnipipe worker: stage {settings.stage}: {error}"
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
