"""Video jobs in Redis: why Redis, and the keys.

Router replicas come and go (a rollout, a crash, a scale-down), so a job's state and its
MP4 live outside them. Redis is what a cluster operator already runs for this (or gets
from a chart), it expires content by itself (the TTL), and its atomic commands and
scripts let replicas share one queue without a lock service. A volume shared by the
router pods would need ReadWriteMany storage and file locking across nodes; a database
would hold the MP4s in rows. Keys, under `omnipipe:videos:<pipeline>:`:

- `job:<id>`: the OpenAI video object (JSON); `params:<id>`: what the stages are given;
- `content:<id>`: the MP4, expiring with the job;
- `queue`: ids waiting for a runner (a list); `jobs`: every id by creation (a sorted set);
- `lease:<id>`: held by the replica running the job, renewed while it runs: a job whose
  lease is gone while it is not finished lost its runner, and is queued again;
- `cancel:<id>`: asks the job's runner to stop.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from omnipipe.router.errors import StageUnavailable

P = ParamSpec("P")
T = TypeVar("T")


class StoreUnavailable(StageUnavailable):
    """The Redis of the video jobs does not answer: a 503, the job untouched."""


def _reported(call: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A store call whose Redis failure is the client's 503, said plainly (the address
    and the driver's words go to the log only)."""

    @functools.wraps(call)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await call(*args, **kwargs)
        except RedisError as exc:
            raise StoreUnavailable(
                "the video job store is unavailable; retry later", retry_after=5
            ) from exc

    return guarded


# Takes the queue's head and the lease on it in one step: no replica can see the job
# neither queued nor leased, and take it for one whose runner died.
_TAKE = """
local id = redis.call('LPOP', KEYS[1])
if not id then return false end
redis.call('SET', ARGV[1] .. id, ARGV[2], 'PX', ARGV[3])
return id
"""
# Renews a lease only while this runner still holds it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# The finished job and its content, unless its client deleted it meanwhile.
_FINISH = """
if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[3])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class VideoStore:
    """One pipeline's jobs. Every method is one or a few round trips."""

    def __init__(self, url: str, pipeline: str) -> None:
        self.redis = aioredis.Redis.from_url(url, decode_responses=False)
        self.prefix = f"omnipipe:videos:{pipeline}:"
        self._take = self.redis.register_script(_TAKE)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._finish = self.redis.register_script(_FINISH)

    def _key(self, kind: str, video_id: str = "") -> str:
        return f"{self.prefix}{kind}:{video_id}" if video_id else f"{self.prefix}{kind}"

    async def close(self) -> None:
        await self.redis.aclose()

    @_reported
    async def ping(self) -> None:
        await self.redis.ping()

    @_reported
    async def create(self, job: dict[str, Any], params: dict[str, Any]) -> None:
        video_id = job["id"]
        async with self.redis.pipeline(transaction=True) as tx:
            tx.set(self._key("job", video_id), json.dumps(job))
            tx.set(self._key("params", video_id), json.dumps(params))
            tx.zadd(self._key("jobs"), {video_id: job["created_at"]})
            tx.rpush(self._key("queue"), video_id)
            await tx.execute()

    @_reported
    async def get(self, video_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._key("job", video_id))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @_reported
    async def params(self, video_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._key("params", video_id))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @_reported
    async def put(self, job: dict[str, Any], ttl_seconds: int | None = None) -> None:
        """Writes the job's object, if it still exists (a client may have deleted it);
        with ttl_seconds, it (and its params) expire then."""
        video_id = job["id"]
        async with self.redis.pipeline(transaction=True) as tx:
            tx.set(self._key("job", video_id), json.dumps(job), ex=ttl_seconds, xx=True)
            if ttl_seconds is not None:
                tx.expire(self._key("params", video_id), ttl_seconds)
            await tx.execute()

    @_reported
    async def finish(self, job: dict[str, Any], mp4: bytes, ttl_seconds: int) -> bool:
        """The content and the completed job, both expiring after ttl_seconds; False when
        the job was deleted (or is being cancelled), and nothing was written."""
        video_id = job["id"]
        keys = [self._key(k, video_id) for k in ("job", "content", "cancel", "params")]
        return bool(await self._finish(keys=keys, args=[json.dumps(job), mp4, ttl_seconds]))

    @_reported
    async def content(self, video_id: str) -> bytes | None:
        raw = await self.redis.get(self._key("content", video_id))
        return raw if raw is None or isinstance(raw, bytes) else raw.encode()

    @_reported
    async def delete(self, video_id: str, cancelling: bool = False) -> None:
        """Removes the job; cancelling: its runner is told to stop (the flag outlives
        the job, until the runner removes it)."""
        kinds = ("job", "params", "content", *(() if cancelling else ("cancel",)))
        await self.redis.delete(*(self._key(k, video_id) for k in kinds))
        await self.redis.zrem(self._key("jobs"), video_id)
        await self.redis.lrem(self._key("queue"), 0, video_id)

    @_reported
    async def ids(self, newest_first: bool) -> list[str]:
        raw = await self.redis.zrange(self._key("jobs"), 0, -1, desc=newest_first)
        return [_text(r) for r in raw]

    @_reported
    async def forget(self, video_ids: list[str]) -> None:
        """Drops ids whose jobs expired from the index."""
        if video_ids:
            await self.redis.zrem(self._key("jobs"), *video_ids)

    @_reported
    async def queued(self) -> list[str]:
        return [_text(r) for r in await self.redis.lrange(self._key("queue"), 0, -1)]

    @_reported
    async def requeue(self, video_id: str) -> None:
        await self.redis.rpush(self._key("queue"), video_id)

    @_reported
    async def take(self, owner: str, lease_ms: int) -> str | None:
        """The next queued job's id, leased to `owner`; None when the queue is empty."""
        got = await self._take(
            keys=[self._key("queue")], args=[f"{self.prefix}lease:", owner, lease_ms]
        )
        return None if not got else bytes(got).decode()

    @_reported
    async def claim(self, video_id: str, owner: str, lease_ms: int) -> bool:
        """The lease of a job nobody holds, for `owner`."""
        return bool(await self.redis.set(self._key("lease", video_id), owner, px=lease_ms, nx=True))

    @_reported
    async def renew(self, video_id: str, owner: str, lease_ms: int) -> bool:
        renewed = await self._renew(keys=[self._key("lease", video_id)], args=[owner, lease_ms])
        return bool(renewed)

    @_reported
    async def release(self, video_id: str, owner: str) -> None:
        await self._release(keys=[self._key("lease", video_id)], args=[owner])

    @_reported
    async def cancel(self, video_id: str, ttl_seconds: int) -> None:
        """Asks the job's runner to stop, and removes the job at once."""
        await self.redis.set(self._key("cancel", video_id), b"1", ex=ttl_seconds)
        await self.delete(video_id, cancelling=True)

    @_reported
    async def cancelled(self, video_id: str) -> bool:
        return bool(await self.redis.exists(self._key("cancel", video_id)))
