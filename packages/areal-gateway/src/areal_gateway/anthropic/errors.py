"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The gateway's errors are `ServiceError`s in OpenAI terms (areal_runtime.errors); a Messages
client gets each with the status and type Anthropic documents for that meaning, so the
official SDK raises the exception it would against Anthropic (`BadRequestError`,
`AuthenticationError`, `RateLimitError`, `OverloadedError`, ...) and retries what Anthropic
says may be retried (429, 529, 5xx):

    400, 422 -> 400 invalid_request_error     413 -> 413 request_too_large
    401 -> 401 authentication_error           403 -> 403 permission_error
    404 -> 404 not_found_error                429 -> 429 rate_limit_error
    503 (draining, no healthy replica) -> 529 overloaded_error
    504 -> 504 timeout_error                  other 4xx -> as is, invalid_request_error
    other 5xx (500, 501, 502, 507) -> 500 api_error
"""

from __future__ import annotations

import orjson

from areal_runtime.errors import InvalidRequest, ServiceError

# HTTP status of the gateway's error -> (Anthropic's status, its error type).
_MAPPED = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    422: (400, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def status_and_type(err: ServiceError) -> tuple[int, str]:
    found = _MAPPED.get(err.http_status)
    if found is not None:
        return found
    if err.http_status < 500:
        return err.http_status, "invalid_request_error"
    return 500, "api_error"


def error_doc(err: ServiceError) -> dict[str, object]:
    _, kind = status_and_type(err)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: ServiceError) -> tuple[int, bytes]:
    """(status, body) of a whole error answer."""
    return status_and_type(err)[0], orjson.dumps(error_doc(err))


def error_event(err: ServiceError) -> bytes:
    """The `error` event that ends a stream whose headers already went out."""
    return b"event: error\ndata: " + orjson.dumps(error_doc(err)) + b"\n\n"


def invalid(path: str, message: str) -> InvalidRequest:
    """A 400 whose message starts with the field's path, as Anthropic's do."""
    return InvalidRequest(f"{path}: {message}" if path else message, param=path or None)


def unsupported(path: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{path}: {message}", code="unsupported_parameter", param=path)
