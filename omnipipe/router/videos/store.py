"""Video jobs in Redis: why Redis, and the keys.

Router replicas come and go (a rollout, a crash, a scale-down), so a job's state and its
MP4 live outside them. Redis is what a cluster operator already runs for this (or gets
from a chart), it expires content by itself (the TTL), and its atomic commands and
scripts let replicas share one queue without a lock service. A volume shared by the
router pods would need ReadWriteMany storage and file locking across nodes; a database
would hold the MP4s in rows. Keys, under `omnipipe:videos:{<namespace>/<pipeline>}:` (one pipeline's
keys share a Redis Cluster slot, so its scripts may touch them all):

- `job:<id>`: the OpenAI video object (JSON); `params:<id>`: what the stages are given;
- `content:<id>`: the MP4, expiring with the job;
- `queue`: ids waiting for a runner (a list, an id at most once), and `queued`, the same
  ids as a set: whether an id waits is one O(1) lookup, so a sweep stays linear in the
  jobs however long the queue; `jobs`: every id by creation (a sorted set, scored by the
  second and then `created`, a counter: jobs of one second list in the order made);
  `active`: the ids of unfinished jobs (a set), what a sweep reads and admission counts;
- `lease:<id>`: held by the replica running the job, renewed while it runs: a job whose
  lease is gone while it is not finished lost its runner, and a sweep queues it again
  (unless that runner, only stalled, renews first and takes the lease back);
- `cancel:<id>`: asks the job's runner to stop;
- `once:<sha256 of an Idempotency-Key>`: "<fingerprint of the request> <id>", for a day:
  a create retried with the same key (after a 503, say) gets the same job.
"""

from __future__ import annotations

import json
from typing import Any, cast

from omnipipe.router.redis_store import connect, reported
from omnipipe.router.videos import scripts

_reported = reported("the video job store")


# How long an Idempotency-Key names its job (Stripe's and OpenAI's day).
IDEMPOTENCY_SECONDS = 24 * 3600


class QueueFull(Exception):
    """The pipeline has as many unfinished jobs as it takes."""


class KeyReused(Exception):
    """An Idempotency-Key already made a job from another request."""

    def __init__(self, video_id: str) -> None:
        super().__init__(video_id)
        self.video_id = video_id


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class VideoStore:
    """One pipeline's jobs. Every method is one or a few round trips."""

    def __init__(self, url: str, namespace: str, pipeline: str, max_unfinished: int = 1000) -> None:
        self.max_unfinished = max_unfinished
        self.redis = connect(url)
        self.prefix = f"omnipipe:videos:{{{namespace}/{pipeline}}}:"
        self._take = self.redis.register_script(scripts.TAKE)
        self._claim = self.redis.register_script(scripts.CLAIM)
        self._requeue = self.redis.register_script(scripts.REQUEUE)
        self._renew = self.redis.register_script(scripts.RENEW)
        self._release = self.redis.register_script(scripts.RELEASE)
        self._finish = self.redis.register_script(scripts.FINISH)
        self._cancel = self.redis.register_script(scripts.CANCEL)
        self._create = self.redis.register_script(scripts.CREATE)

    def _key(self, kind: str, video_id: str = "") -> str:
        return f"{self.prefix}{kind}:{video_id}" if video_id else f"{self.prefix}{kind}"

    async def close(self) -> None:
        await self.redis.aclose()

    @_reported
    async def ping(self) -> None:
        await self.redis.ping()

    @_reported
    async def create(
        self, job: dict[str, Any], params: dict[str, Any], once: tuple[str, str] | None = None
    ) -> str:
        """Queues the job; its id. With `once`, (the digest of an Idempotency-Key, the
        request's fingerprint): the id of the job that key made instead, if it still
        exists; KeyReused if that key made one from another request; QueueFull when
        `max_unfinished` jobs are unfinished already."""
        video_id = job["id"]
        digest, fingerprint = once or ("", "")
        keys = [
            self._key("once", digest) if digest else self._key("once"),
            self._key("job", video_id),
            self._key("params", video_id),
            *(self._key(k) for k in ("jobs", "active", "queue", "queued", "created")),
        ]
        args = [
            fingerprint,
            video_id,
            json.dumps(job),
            json.dumps(params),
            job["created_at"],
            IDEMPOTENCY_SECONDS,
            f"{self.prefix}job:",
            self.max_unfinished,
        ]
        outcome, made = await self._create(keys=keys, args=args)
        if int(outcome) == 0:
            raise KeyReused(_text(made))
        if int(outcome) == 3:
            raise QueueFull()
        return _text(made)

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
        """Writes the job's object, if it still exists (a client may have deleted it).
        With ttl_seconds the job is finished (failed): it and its params expire then."""
        video_id = job["id"]
        async with self.redis.pipeline(transaction=True) as tx:
            tx.set(self._key("job", video_id), json.dumps(job), ex=ttl_seconds, xx=True)
            if ttl_seconds is not None:
                tx.expire(self._key("params", video_id), ttl_seconds)
                tx.srem(self._key("active"), video_id)
            await tx.execute()

    @_reported
    async def finish(self, job: dict[str, Any], mp4: bytes, ttl_seconds: int, owner: str) -> bool:
        """The content and the completed job, both expiring after ttl_seconds; False when
        the job was deleted (or is being cancelled) or `owner` no longer holds it, and
        nothing was written."""
        video_id = job["id"]
        kinds = ("job", "content", "cancel", "params", "lease")
        keys = [*(self._key(k, video_id) for k in kinds), self._key("active")]
        args = [json.dumps(job), mp4, ttl_seconds, owner, video_id]
        return bool(await self._finish(keys=keys, args=args))

    @_reported
    async def content_length(self, video_id: str) -> int:
        """The MP4's bytes; 0 once it expired (no MP4 is empty)."""
        return int(await self.redis.strlen(self._key("content", video_id)))

    @_reported
    async def content_part(self, video_id: str, first: int, last: int) -> bytes:
        """Bytes first..last of the MP4: a download reads it a part at a time, as its
        client takes them, so a slow client holds one part and not the video."""
        raw = await self.redis.getrange(self._key("content", video_id), first, last)
        return raw if isinstance(raw, bytes) else raw.encode()

    @_reported
    async def delete(self, video_id: str) -> None:
        """Removes the job, and the flag that told a runner to stop it."""
        kinds = ("job", "params", "content", "cancel")
        async with self.redis.pipeline(transaction=True) as tx:
            tx.delete(*(self._key(k, video_id) for k in kinds))
            tx.zrem(self._key("jobs"), video_id)
            tx.srem(self._key("active"), video_id)
            tx.lrem(self._key("queue"), 0, video_id)
            tx.srem(self._key("queued"), video_id)
            await tx.execute()

    @_reported
    async def page(self, after: str | None, count: int, newest_first: bool) -> list[str] | None:
        """Up to `count` ids in creation order (or its reverse) after `after`; None when
        `after` is no job's id."""
        start = 0
        if after is not None:
            rank = await (
                self.redis.zrevrank(self._key("jobs"), after)
                if newest_first
                else self.redis.zrank(self._key("jobs"), after)
            )
            if not isinstance(rank, int):
                return None  # None: no such member
            start = rank + 1
        raw = await self.redis.zrange(
            self._key("jobs"), start, start + count - 1, desc=newest_first
        )
        return [_text(r) for r in raw]

    @_reported
    async def jobs(self, video_ids: list[str]) -> list[dict[str, Any] | None]:
        if not video_ids:
            return []
        raw = await self.redis.mget([self._key("job", v) for v in video_ids])
        return [None if r is None else cast(dict[str, Any], json.loads(r)) for r in raw]

    @_reported
    async def unfinished(self) -> list[str]:
        return sorted(_text(r) for r in await self.redis.smembers(self._key("active")))

    @_reported
    async def orphan_candidates(self, video_ids: list[str]) -> list[str]:
        """Those of `video_ids` neither queued nor leased now, in two round trips and
        one lookup per id; a claim decides for each, atomically."""
        if not video_ids:
            return []
        waiting = await self.redis.smismember(self._key("queued"), video_ids)
        unqueued = [v for v, w in zip(video_ids, waiting, strict=True) if not w]
        if not unqueued:
            return []
        async with self.redis.pipeline(transaction=False) as batch:
            for video_id in unqueued:
                batch.exists(self._key("lease", video_id))
            leased = await batch.execute()
        return [v for v, held in zip(unqueued, leased, strict=True) if not held]

    @_reported
    async def forget(self, video_ids: list[str]) -> None:
        """Drops ids whose jobs expired from the index and the unfinished set."""
        if video_ids:
            async with self.redis.pipeline(transaction=True) as tx:
                tx.zrem(self._key("jobs"), *video_ids)
                tx.srem(self._key("active"), *video_ids)
                await tx.execute()

    @_reported
    async def requeue(self, video_id: str) -> None:
        """Queues the job again, unless it is queued already."""
        await self._requeue(keys=[self._key("queue"), self._key("queued")], args=[video_id])

    @_reported
    async def take(self, owner: str, lease_ms: int) -> str | None:
        """The next queued job's id, leased to `owner`; None when the queue is empty (or
        its head is another's to queue again)."""
        got = await self._take(
            keys=[self._key("queue"), f"{self.prefix}lease:", self._key("queued")],
            args=[owner, lease_ms],
        )
        return None if not got else _text(got)

    @_reported
    async def claim(self, video_id: str, owner: str, lease_ms: int) -> bool:
        """The lease of a job that is neither queued nor leased, for `owner`."""
        claimed = await self._claim(
            keys=[self._key("queued"), self._key("lease", video_id)],
            args=[video_id, owner, lease_ms],
        )
        return bool(claimed)

    @_reported
    async def renew(self, video_id: str, owner: str, lease_ms: int) -> bool:
        keys = [self._key("lease", video_id), self._key("queued"), self._key("active")]
        keys.append(self._key("cancel", video_id))
        renewed = await self._renew(keys=keys, args=[owner, lease_ms, video_id])
        return bool(renewed)

    @_reported
    async def release(self, video_id: str, owner: str) -> None:
        await self._release(keys=[self._key("lease", video_id)], args=[owner])

    @_reported
    async def cancel(self, video_id: str, ttl_seconds: int) -> None:
        """Removes an unfinished job at once, and tells a runner that may hold it to stop
        (the flag outlives the job until that runner, or the TTL, removes it)."""
        keys = [
            self._key("queue"),
            self._key("lease", video_id),
            *(self._key(k, video_id) for k in ("job", "params", "content")),
            self._key("jobs"),
            self._key("active"),
            self._key("cancel", video_id),
            self._key("queued"),
        ]
        await self._cancel(keys=keys, args=[video_id, ttl_seconds])

    @_reported
    async def cancelled(self, video_id: str) -> bool:
        return bool(await self.redis.exists(self._key("cancel", video_id)))
