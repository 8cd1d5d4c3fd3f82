"""`omnipipe router`: serve the OpenAI-compatible API for one pipeline."""

from __future__ import annotations

import logging

import uvicorn

from omnipipe.api.loading import load_pipeline
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings


def run_router(settings: RouterSettings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [router] %(name)s: %(message)s"
    )
    # One line per replica poll would drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(load_pipeline(settings.pipeline_file), settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
