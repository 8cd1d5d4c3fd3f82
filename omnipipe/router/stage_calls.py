"""One stage's part in a request, over HTTP: submit it to the chosen replica, forward the
replica's events to the request, cancel it; and the errors a stage's failure reaches the
client as."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import aiohttp

from omnipipe.api.tracing import TRACEPARENT
from omnipipe.api.wire import StageEvent, SubmitRequest, usage_counts
from omnipipe.router.errors import (
    BadRequest,
    GatewayTimeout,
    OpenAIError,
    StageUnavailable,
    relayed_message,
)
from omnipipe.router.outputs import Output, OutputPart, Progress, StageDone
from omnipipe.router.replicas import Replica, ReplicaPool
from omnipipe.router.stage_events import PartAssembler, StreamBroken, event_stream

log = logging.getLogger(__name__)


class StageFailed(OpenAIError):
    status, type = 500, "server_error"


class ReplicaDeclined(StageUnavailable):
    """The chosen replica never took the request: it refused the connection, or answered
    the submission with 503 (loading or draining). Nothing ran there, so the request
    may be planned again."""


class ReplicaLost(StageUnavailable):
    """A replica's stream broke mid-request (its connection dropped or timed out). When
    an upstream stage's replica dies, a downstream stream can break in the same moment:
    the client hears the upstream one, the cause."""


# How long a stage's lost stream waits for a stage upstream of it to fail too.
ROOT_CAUSE_GRACE_SECONDS = 0.5


def _error_for(stage: str, event: StageEvent) -> OpenAIError:
    """A worker's error event as the router's own errors are shaped: a 400 names the
    field (`param`) the worker named, as the router's checks do."""
    message = relayed_message(event.message)
    if event.code == "invalid_request":
        return BadRequest(message, param=event.param or None)
    if event.code == "timeout":
        return GatewayTimeout(message, code=event.code)
    if event.code == "stage_unavailable":
        return StageUnavailable(message, code=event.code)
    return StageFailed(f"stage {stage} failed: {message}", code=event.code or None)


async def stream_stage(
    session: aiohttp.ClientSession,
    pool: ReplicaPool,
    stage: str,
    replica: Replica,
    submit: SubmitRequest,
    sink: asyncio.Queue[Output | OutputPart | StageDone],
    *,
    whole: bool,
    traceparent: str,
    on_progress: Progress | None,
    limit_seconds: float,
) -> None:
    """Submit `submit` to the stage's replica and put its results on `sink` (whole, or
    in parts) until the stage is done; a replica that fails is marked down in `pool`."""
    parts = PartAssembler()
    trace_headers = {TRACEPARENT: traceparent} if traceparent else {}
    try:
        async with session.post(
            f"{replica.url}/v1/requests",
            # Left out when off: a worker of an older version forbids the field.
            data=submit.model_dump_json(exclude=None if submit.progress else {"progress"}),
            # W3C trace context rides as the HTTP header: a worker that predates
            # tracing ignores it (the body's model forbids unknown fields).
            headers={"content-type": "application/json", **trace_headers},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=limit_seconds),
        ) as resp:
            if resp.status != 200:
                body = (await resp.content.read(500)).decode(errors="replace")
                log.warning("stage %s at %s: HTTP %d %s", stage, replica.url, resp.status, body)
                refused = ReplicaDeclined if resp.status == 503 else StageUnavailable
                if resp.status == 503:
                    pool.mark_down(replica)
                raise refused(f"stage {stage} refused the request (HTTP {resp.status})")
            async for event in event_stream(resp.content):
                if event.type == "part":
                    if whole:
                        parts.add(event)
                    else:
                        await sink.put(OutputPart(stage, event.index, event.key, event.text))
                elif event.type == "result":
                    data = parts.complete(event) if whole else event.data
                    await sink.put(Output(stage, data, event.index))
                elif event.type == "progress":
                    if on_progress is not None:
                        on_progress(stage, int(event.data["step"]), int(event.data["steps"]))
                elif event.type == "error":
                    raise _error_for(stage, event)
                else:
                    await sink.put(StageDone(stage, usage_counts(event.data)))
                    return
    except OpenAIError:
        raise
    # The client hears which stage and what happened; the replica's address and the
    # exception's repr go to the log only.
    except StreamBroken as exc:
        log.warning("stage %s at %s sent %s", stage, replica.url, exc)
        pool.mark_down(replica)
        raise StageFailed(f"stage {stage} sent {exc}") from exc
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        log.warning("stage %s at %s unreachable: %r", stage, replica.url, exc)
        pool.mark_down(replica)
        raise ReplicaDeclined(f"stage {stage} failed: its replica went away") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("stage %s at %s failed: %r", stage, replica.url, exc)
        pool.mark_down(replica)
        raise ReplicaLost(f"stage {stage} failed: its replica went away") from exc
    except Exception as exc:
        # Whatever else reading the stream raises, the client gets a clean error.
        log.exception("reading stage %s from %s failed", stage, replica.url)
        pool.mark_down(replica)
        raise StageFailed(f"stage {stage} failed while streaming its result") from exc
    log.warning("stage %s at %s closed the stream early", stage, replica.url)
    pool.mark_down(replica)
    raise StageUnavailable(f"stage {stage} closed the stream early")


async def cancel_request(
    session: aiohttp.ClientSession, request_id: str, replicas: Iterable[Replica]
) -> None:
    """Best effort: a replica that is gone or slow holds nothing worth waiting for."""

    async def one(replica: Replica) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(
                f"{replica.url}/v1/requests/{request_id}/cancel",
                timeout=aiohttp.ClientTimeout(total=2.0),
            ):
                pass

    await asyncio.gather(*(one(r) for r in replicas))


async def first_failure(tasks: Sequence[asyncio.Task[None]]) -> BaseException | None:
    """The failure of the most upstream stage (tasks are in pipeline order), or None. A
    lost stream first gives the stages upstream of it a moment to fail as well."""
    failed = [t for t in tasks if t.done() and t.exception() is not None]
    if not failed:
        return None
    upstream = [t for t in tasks[: tasks.index(failed[0])] if not t.done()]
    if upstream and isinstance(failed[0].exception(), ReplicaLost):
        await asyncio.wait(upstream, timeout=ROOT_CAUSE_GRACE_SECONDS)
    return next(t.exception() for t in tasks if t.done() and t.exception() is not None)
