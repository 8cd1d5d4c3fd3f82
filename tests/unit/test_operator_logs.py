"""The operator's log filter: a server-advised retry is a warning, a real failure an error."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from kopf._cogs.clients.errors import APIServerError, APITooManyRequestsError

from omnipipe.operator.logs import ServerBackoffIsAWarning

WATCH = "GET https://127.0.0.1:6443/apis/omnipipe.io/v1alpha1/omnipipelines?watch=true"


@pytest.fixture
def log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handler.addFilter(ServerBackoffIsAWarning())
    # kopf's own logger name, as in the line the operator logged after `helm install`.
    logger = logging.getLogger("kopf._cogs.clients.watching")
    logger.addHandler(handler)
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)


def too_many() -> APITooManyRequestsError:
    status = {"message": "storage is (re)initializing", "code": 429}
    return APITooManyRequestsError(status, status=429, headers={})  # type: ignore[arg-type]


def test_a_retried_429_is_a_warning(log: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = log
    # The f-string kopf's request() logs (kopf/_cogs/clients/api.py), with kopf's error.
    logger.error(f"Request attempt #1/9 failed; will retry: {WATCH} -> {too_many()!r}")
    assert out.getvalue().startswith("WARNING kopf._cogs.clients.watching Request attempt #1/9")


def test_a_429_that_runs_out_of_retries_stays_an_error(
    log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = log
    logger.error(f"Request attempt #9/9 failed; escalating: {WATCH} -> {too_many()!r}")
    assert out.getvalue().startswith("ERROR ")


def test_a_retried_server_error_stays_an_error(log: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = log
    failure = APIServerError({"message": "etcd timeout", "code": 500}, status=500, headers={})  # type: ignore[arg-type]
    logger.error(f"Request attempt #1/9 failed; will retry: {WATCH} -> {failure!r}")
    assert out.getvalue().startswith("ERROR ")
