"""What the router's Redis-backed stores share (video jobs, router/videos/store.py; voices,
router/voice_store.py): one way to connect, and one way a Redis that does not answer
reaches a client."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omnipipe.router.errors import StageUnavailable

P = ParamSpec("P")
T = TypeVar("T")
# A store that stops answering is a 503 in this long, not a hung request.
SOCKET_TIMEOUT_SECONDS = 5.0


class StoreUnavailable(StageUnavailable):
    """The router's Redis does not answer in time: a 503. What the call was writing may
    still have been applied (a stalled Redis runs it once it wakes): a retried video
    create makes a second job unless both carry the same Idempotency-Key."""


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT_SECONDS,
        socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
        health_check_interval=30,
    )


def reported(
    store: str,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """A store call whose Redis failure is the client's 503, naming `store` plainly (the
    address and the driver's words go to the log only)."""

    def wrap(call: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(call)
        async def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await call(*args, **kwargs)
            except RedisError as exc:
                raise StoreUnavailable(
                    f"{store} is unavailable; retry later", retry_after=5
                ) from exc

        return guarded

    return wrap
