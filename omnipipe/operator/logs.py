"""The operator's log setup: one line per decision, and errors only for what went wrong."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class ServerBackoffIsAWarning(logging.Filter):
    """kopf logs every retried request at ERROR. A 429 is the API server asking for a
    moment (a CRD's watch cache starting after `helm install`, or re-initialising after an
    upgrade) and kopf waits the Retry-After it gives; nothing is wrong yet. The retry that
    runs out still logs "escalating" at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.name.startswith("kopf."):
            message = record.getMessage()
            if "will retry" in message and "status=429" in message:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_operator_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    # On the handlers, not a logger: kopf logs through many loggers and per-object adapters.
    for handler in logging.getLogger().handlers:
        handler.addFilter(ServerBackoffIsAWarning())
    # A line per API request would drown the decisions worth reading.
    for noisy in ("httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
