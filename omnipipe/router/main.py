"""`omnipipe router`: serve the OpenAI-compatible API for one pipeline."""

from __future__ import annotations

import gc
import logging

import uvicorn

from omnipipe.api.constants import SERVER_KEEP_ALIVE_SECONDS
from omnipipe.api.loading import load_pipeline
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings


def run_router(settings: RouterSettings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [router] %(name)s: %(message)s"
    )
    # One line per replica poll would drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # At the default 700 allocations CPython's cycle collector ran thousands of times a
    # second under load, and its passes walk what every in-flight request keeps alive:
    # with 512 in flight it held the router to half its throughput, and to 0.8x at 64
    # (bench/router_overhead.py). Peak memory under that load did not change.
    gc.set_threshold(100_000, 10, 10)
    app = build_app(load_pipeline(settings.pipeline_file), settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_keep_alive=SERVER_KEEP_ALIVE_SECONDS,
    )
