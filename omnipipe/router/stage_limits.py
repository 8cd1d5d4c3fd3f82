"""What each stage's loaded model bounds in a request (api/param_limits.py), asked of a
ready replica (GET /control/limits) and kept per stage and revision: every replica of a
revision runs the same model. A request past one is the client's 400 before any work
is queued; a stage that cannot be asked is not waited for (it checks the request
itself when the request reaches it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx
from pydantic import ValidationError

from omnipipe.api.param_limits import ParamLimit, StageLimits
from omnipipe.router.replicas import ReplicaPool

log = logging.getLogger(__name__)

# A ready replica answers from memory: one that takes longer is busy or stuck, and the
# request does not wait longer for it.
ASK_TIMEOUT_SECONDS = 2.0
# Revisions a long-lived router has seen: enough for any rollout, bounded for all.
MAX_KEPT = 64


class KnownLimits:
    def __init__(self, pool: ReplicaPool, client: httpx.AsyncClient, headers: dict[str, str]):
        self._pool = pool
        self._client = client
        self._headers = headers
        self._kept: dict[tuple[str, str], tuple[ParamLimit, ...]] = {}

    async def of(self, stages: Sequence[str], revision: str | None) -> list[ParamLimit]:
        """The limits of `stages`, from replicas of `revision` (the one the request will
        start on) when one is ready, else of another."""
        found = await asyncio.gather(*(self._stage(s, revision) for s in stages))
        return [limit for limits in found for limit in limits]

    async def _stage(self, stage: str, revision: str | None) -> tuple[ParamLimit, ...]:
        ready = sorted(self._pool.ready_revisions(stage), key=lambda r: r[1] != revision)
        # Two tries at most, so that a stuck replica holds a request ASK_TIMEOUT_SECONDS
        # twice at worst.
        for url, its_revision in ready[:2]:
            if (kept := self._kept.get((stage, its_revision))) is not None:
                return kept
            limits = await self._ask(url)
            if limits is None:
                continue
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            self._kept[(stage, its_revision)] = limits
            return limits
        return ()

    async def _ask(self, url: str) -> tuple[ParamLimit, ...] | None:
        try:
            resp = await self._client.get(
                f"{url}/control/limits", headers=self._headers, timeout=ASK_TIMEOUT_SECONDS
            )
        except httpx.HTTPError as exc:
            log.info("no limits from %s: %r", url, exc)
            return None
        # Not 200: a replica that cannot say now, or a worker from before the route (404),
        # which an upgrade in place may replace under the same revision: asked again.
        if resp.status_code != 200:
            return None
        try:
            return StageLimits.model_validate_json(resp.content).limits
        except ValidationError:
            log.warning("%s/control/limits answered what is not a StageLimits", url)
            return None
