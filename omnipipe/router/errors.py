"""Domain errors mapped to OpenAI-shaped error bodies and status codes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from omnipipe.api.plain_text import plain_message

MAX_RELAYED_CHARS = 1000
# No message is longer: one that quotes a client's value cut short keeps its two ends.
MAX_MESSAGE_CHARS = 2000


def bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = MAX_MESSAGE_CHARS // 2 - 8
    return f"{message[:half]} [...] {message[-half:]}"


def relayed_message(message: str) -> str:
    """A worker's message as the client may see it: no object reprs, and bounded (a
    stage names its limits; it never needs a page)."""
    return plain_message(message, MAX_RELAYED_CHARS)


class OpenAIError(Exception):
    status = 500
    type = "server_error"
    # Seconds a client should wait before trying again, where no error says otherwise.
    default_retry_after: int | None = None

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message, self.param, self.code, self.retry_after = message, param, code, retry_after

    def body(self) -> dict[str, str | None]:
        """OpenAI's error object, in a response body or a stream's error event alike."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        retry_after = self.retry_after or self.default_retry_after
        if retry_after:
            headers["Retry-After"] = str(retry_after)
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=headers)


class BadRequest(OpenAIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(OpenAIError):
    status, type = 401, "authentication_error"


class ModelNotFound(OpenAIError):
    status, type = 404, "invalid_request_error"


class UnknownRoute(OpenAIError):
    status, type = 404, "invalid_request_error"


class MethodNotAllowed(OpenAIError):
    status, type = 405, "invalid_request_error"


class Conflict(OpenAIError):
    """The call cannot be done in the pipeline's present state or setup (a stage that
    cannot do it, a change the resource owns)."""

    status, type = 409, "invalid_request_error"


class PayloadTooLarge(OpenAIError):
    status, type = 413, "invalid_request_error"


class Overloaded(OpenAIError):
    status, type = 429, "rate_limit_error"


class StageUnavailable(OpenAIError):
    """A stage that cannot take the request now (paused, its replica draining): every
    such 503 tells the client when to try again."""

    status, type = 503, "service_unavailable"
    default_retry_after = 5


class GatewayTimeout(OpenAIError):
    status, type = 504, "timeout"


class InternalError(OpenAIError):
    status, type = 500, "server_error"


async def openai_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no route, wrong method) in OpenAI's shape, as OpenAI
    answers them."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    error: OpenAIError
    if exc.status_code == 404:
        error = UnknownRoute(f"Invalid URL ({where})", code="unknown_url")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = MethodNotAllowed(
            f"Method not allowed ({where}); allowed: {allowed}", code="method_not_allowed"
        )
    else:
        error = OpenAIError(str(exc.detail), code=None)
        error.status = exc.status_code
        error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error.response(dict(exc.headers or {}))


async def internal_error_handler(_request: Request, _exc: Exception) -> JSONResponse:
    """A bug is still answered in OpenAI's shape (Starlette re-raises it afterwards, so
    the server logs the traceback)."""
    return InternalError("internal error in the router", code="internal_error").response()
