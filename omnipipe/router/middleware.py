"""Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from
endpoints): API-key auth, the body-size limit, request metrics, and each request's
root span (a child of the client's traceparent, if it sent one)."""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import trace

from omnipipe.api.tracing import header, parent_context
from omnipipe.router.errors import BadRequest, OpenAIError, PayloadTooLarge, Unauthorized
from omnipipe.router.metrics import RouterMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# The separators (commas and colons) a body other than a multipart form may hold. Parsing
# a JSON value costs the event loop about a microsecond, and the body-size limit alone let
# 2 million members through: 6 s of a router answering nobody, and other clients' video
# jobs lost their runner. A hundred thousand is far past any real request (base64 media
# has no commas; the models' contexts end long before a text of that many).
MAX_BODY_SEPARATORS = 100_000
# The routes that read multipart forms.
FORM_PATHS = ("/v1/images/edits", "/v1/videos", "/v1/audio/voices")
ADMIN_PREFIX = "/admin"


def bearer(key: str | None) -> bytes | None:
    return f"Bearer {key}".encode() if key is not None else None


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        pipeline: str,
        api_key: str | None,
        max_body_bytes: int,
        admin_api_key: str | None = None,
        metrics: RouterMetrics,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.app = app
        self.tracer = tracer or trace.NoOpTracer()
        self.pipeline = pipeline
        self.expected = bearer(api_key)
        self.admin_expected = bearer(admin_api_key)
        self.max_body = max_body_bytes
        self.metrics = metrics

    def _expected(self, path: str) -> bytes | None:
        """The Authorization header the path needs; None: any."""
        admin = path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")
        if admin and self.admin_expected is not None:
            return self.admin_expected
        return self.expected

    def _reject(self, scope: Scope) -> OpenAIError | None:
        raw = scope.get("headers") or []
        headers = dict(raw)
        expected = self._expected(scope["path"])
        if expected is not None:
            # Two Authorization headers are refused, not settled by which comes last: a
            # proxy that adds one must not let a client's own decide.
            sent = [value for name, value in raw if name == b"authorization"]
            if len(sent) != 1 or not hmac.compare_digest(sent[0], expected):
                return Unauthorized("invalid or missing API key", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return PayloadTooLarge(f"request body over {self.max_body} bytes")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # The key as a request's, in the handshake's Authorization header. A refused
            # handshake is closed before it is accepted: the client gets an HTTP 403.
            if self._reject(scope) is not None:
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = {"code": 500}

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        received = separators = 0
        # The first Content-Type, as Starlette reads it. Only the routes that read forms
        # skip the count (their max_fields bounds a form; a file's bytes hold commas):
        # elsewhere a body is parsed as JSON whatever its type says.
        content_type = next(
            (v for k, v in scope.get("headers") or [] if k == b"content-type"), b""
        ).lower()
        form = content_type.startswith(b"multipart/form-data")
        counted = not (form and scope["path"].startswith(FORM_PATHS))

        async def receive_limited() -> Message:
            # A chunked body has no Content-Length: count it as it arrives, and stop the
            # endpoint reading it (its error handler answers 413 or 400) past a limit.
            nonlocal received, separators
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                received += len(body)
                if received > self.max_body:
                    raise PayloadTooLarge(f"request body over {self.max_body} bytes")
                if counted:
                    separators += body.count(b",") + body.count(b":")
                    if separators > MAX_BODY_SEPARATORS:
                        raise BadRequest(
                            f"request body holds over {MAX_BODY_SEPARATORS} commas and colons "
                            "(JSON members and elements): far more than any request needs"
                        )
            return message

        error = self._reject(scope)
        method = str(scope.get("method", ""))
        # A span for API calls only, and only for clients that passed the key: an
        # unauthenticated caller must not be able to force traces (its traceparent's
        # sampled flag) or fill the collector with scans.
        tracer = (
            self.tracer
            if error is None and scope["path"].startswith("/v1/")
            else trace.NoOpTracer()
        )
        span = tracer.start_span(
            f"{method} {scope['path']}",
            context=parent_context(header(dict(scope.get("headers") or []))),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "omnipipe.pipeline": self.pipeline},
        )
        try:
            # Current while the endpoint runs, and in the tasks it starts (a streamed
            # body's): the orchestrator hands it to the stages as their traceparent.
            with trace.use_span(span, end_on_exit=False):
                if error is not None:
                    await error.response()(scope, receive, send_recording)
                else:
                    await self.app(scope, receive_limited, send_recording)
        finally:
            # The route's template, never the raw path: a scanner's made-up paths must not
            # grow a metric series each.
            route = scope.get("route")
            path = str(getattr(route, "path", "unmatched"))
            span.update_name(f"{method} {path}")
            span.set_attribute("http.route", path)
            span.set_attribute("http.response.status_code", status["code"])
            # An error status use_span set for an exception keeps its description.
            recorded = getattr(span, "status", None)
            unset = recorded is None or recorded.status_code is trace.StatusCode.UNSET
            if status["code"] >= 500 and unset:
                span.set_status(trace.StatusCode.ERROR)
            span.end()
            if scope["path"].startswith("/v1/"):
                self.metrics.requests.labels(self.pipeline, path, str(status["code"])).inc()
                self.metrics.duration.labels(self.pipeline, path).observe(
                    time.monotonic() - started
                )
