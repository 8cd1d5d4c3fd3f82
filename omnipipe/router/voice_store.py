"""Uploaded voices in Redis, where the router replicas of a pipeline share them and a
restarted router finds them: the Redis that keeps video jobs (OMNIPIPE_ROUTER_VIDEO_STORE).
Keys, under `omnipipe:voices:{<namespace>/<pipeline>}:` (one Redis Cluster slot):
`voice:<name>` a hash of the clip (`clip`, the WAV as uploaded), what is said of it
(`meta`, JSON) and its prompt (`prompt`, JSON: what the talker made of the clip, once);
`names` the set of names, what the count per pipeline is checked against."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from omnipipe.router.redis_store import connect, reported

# Adds a voice unless its name is taken (0) or the pipeline has as many as it keeps (2).
_ADD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[3]) then return 2 end
redis.call('HSET', KEYS[1], 'clip', ARGV[1], 'meta', ARGV[2])
if ARGV[5] ~= 'null' then redis.call('HSET', KEYS[1], 'prompt', ARGV[5]) end
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""
# A prompt made after the upload, kept only for the voice it was made of: not when that
# voice was deleted meanwhile, nor when another was uploaded under its name (its meta,
# which carries its upload time, differs), nor over a prompt made meanwhile.
_SET_PROMPT = """
if redis.call('HGET', KEYS[1], 'meta') ~= ARGV[2] then return 0 end
return redis.call('HSETNX', KEYS[1], 'prompt', ARGV[1])
"""
_reported = reported("the voice store")


class VoiceTaken(Exception):
    """A voice of that name exists: delete it first."""


class VoicesFull(Exception):
    """The pipeline keeps as many voices as it may."""


class ClipRefused(Exception):
    """The talker refused a voice's clip (too short, not audio it reads): its reason."""


# A clip (and its transcript) -> its prompt, or None when none can be made now.
PromptMaker = Callable[[bytes, str | None], Awaitable[dict[str, Any] | None]]


class StoredVoice:
    """`stored_meta`: the meta as stored, what names this upload of the voice."""

    def __init__(
        self, clip: bytes, stored_meta: str | bytes, prompt: dict[str, Any] | None
    ) -> None:
        self.clip, self.stored_meta, self.prompt = clip, stored_meta, prompt
        self.meta: dict[str, Any] = json.loads(stored_meta)


class VoiceStore:
    """`make_prompt`, set by the app once it can reach the stages: how a voice's prompt
    is made (by a talker replica); none: voices are spoken from their clips."""

    def __init__(self, url: str, namespace: str, pipeline: str, max_voices: int) -> None:
        self.max_voices = max_voices
        self.redis = connect(url)
        self.prefix = f"omnipipe:voices:{{{namespace}/{pipeline}}}:"
        self._add = self.redis.register_script(_ADD)
        self._set_prompt = self.redis.register_script(_SET_PROMPT)
        self.make_prompt: PromptMaker | None = None

    def _key(self, name: str) -> str:
        return f"{self.prefix}voice:{name}"

    @_reported
    async def add(
        self, name: str, clip: bytes, meta: dict[str, Any], prompt: dict[str, Any] | None
    ) -> None:
        added = await self._add(
            keys=[self._key(name), f"{self.prefix}names"],
            args=[clip, json.dumps(meta), self.max_voices, name, json.dumps(prompt or None)],
        )
        if added == 0:
            raise VoiceTaken(name)
        if added == 2:
            raise VoicesFull(name)

    @_reported
    async def voice(self, name: str) -> StoredVoice | None:
        """A voice's clip, what is said of it and its prompt (None until one is made),
        or None when there is no such voice."""
        raw, meta, prompt = await self.redis.hmget(self._key(name), ["clip", "meta", "prompt"])
        if raw is None or meta is None:
            return None
        clip = raw if isinstance(raw, bytes) else raw.encode()
        return StoredVoice(clip, meta, json.loads(prompt) if prompt else None)

    @_reported
    async def set_prompt(self, voice: str, made_of: StoredVoice, prompt: dict[str, Any]) -> bool:
        """Keeps `prompt`, made of `made_of`, while `voice` is still that upload and has
        none; whether it was kept."""
        kept = await self._set_prompt(
            keys=[self._key(voice)], args=[json.dumps(prompt), made_of.stored_meta]
        )
        return bool(kept)

    @_reported
    async def listed(self) -> list[dict[str, Any]]:
        """Every voice's meta, by name."""
        members = await self.redis.smembers(f"{self.prefix}names")
        names = sorted(n.decode() if isinstance(n, bytes) else n for n in members)
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(self._key(name), "meta")
            metas = await pipe.execute()
        return [json.loads(m) for m in metas if m is not None]

    @_reported
    async def delete(self, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as tx:
            tx.delete(self._key(name))
            tx.srem(f"{self.prefix}names", name)
            removed, _ = await tx.execute()
        return bool(removed)

    async def close(self) -> None:
        await self.redis.aclose()
