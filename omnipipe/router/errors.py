"""Domain errors mapped to OpenAI-shaped error bodies and status codes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.retry_after = message, param, code, retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


class BadRequest(OpenAIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(OpenAIError):
    status, type = 401, "authentication_error"


class ModelNotFound(OpenAIError):
    status, type = 404, "invalid_request_error"


class PayloadTooLarge(OpenAIError):
    status, type = 413, "invalid_request_error"


class Overloaded(OpenAIError):
    status, type = 429, "rate_limit_error"


class StageUnavailable(OpenAIError):
    status, type = 503, "service_unavailable"


class GatewayTimeout(OpenAIError):
    status, type = 504, "timeout"


async def openai_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()
