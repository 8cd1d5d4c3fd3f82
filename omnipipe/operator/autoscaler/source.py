"""Instant queries against the Prometheus HTTP API."""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class QueryResult:
    value: float | None
    error: str | None = None
    # PrometheusUnavailable (could not ask) or QueryRejected (asked; it refused).
    error_reason: str = "PrometheusUnavailable"


class PrometheusSource:
    def __init__(self, client: httpx.AsyncClient, timeout: float = 5.0) -> None:
        self._client = client
        self._timeout = timeout

    async def query(self, base_url: str, expr: str) -> QueryResult:
        try:
            resp = await self._client.get(
                f"{base_url.rstrip('/')}/api/v1/query",
                params={"query": expr},
                timeout=self._timeout,
            )
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            return QueryResult(None, f"Prometheus at {base_url} unreachable: {exc!r}")
        if body.get("status") != "success":
            return QueryResult(
                None, f"Prometheus rejected {expr!r}: {body.get('error')}", "QueryRejected"
            )
        data = body["data"]
        if data["resultType"] == "scalar":
            return QueryResult(float(data["result"][1]))
        if not data["result"]:
            return QueryResult(None)
        value = float(data["result"][0]["value"][1])
        return QueryResult(None if math.isnan(value) else value)
