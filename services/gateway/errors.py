"""OpenAI-style errors: every refusal is `{"error": {message, type, param, code}}` with a
status that tells the client whether retrying can help."""

from __future__ import annotations

import re

import msgspec

from shared.protocol import RequestError

RETRY_AFTER_S = 1


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ApiError(Exception):
    """A request that ends in an error response (or an error event mid-stream)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", code="no_scheduler", retry_after_s=RETRY_AFTER_S)


def internal(message: str) -> ApiError:
    return ApiError(500, message, "server_error")


def from_scheduler(err: RequestError) -> ApiError:
    """The scheduler's verdict on one request, as the HTTP status a client acts on."""
    if err.type == "invalid_request_error":
        return ApiError(400, err.message, err.type)
    if err.type == "overloaded":
        return ApiError(429, err.message, err.type, retry_after_s=RETRY_AFTER_S)
    if err.type == "service_unavailable":
        return ApiError(503, err.message, err.type, retry_after_s=RETRY_AFTER_S)
    return ApiError(500, err.message, err.type)


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """msgspec's message names the offending field as a JSON path (`$.messages[0].role`);
    that path becomes the error's `param`."""
    text = str(e)
    if isinstance(e, msgspec.ValidationError):
        m = _PATH.search(text)
        return bad_request(text, param=m.group(1) if m and m.group(1) else None)
    return bad_request(f"request body is not valid JSON: {text}", code="invalid_json")
