"""OpenAI-shaped error responses: `{"error": {"message", "type", "code", "param"}}`.

Every error the gateway answers goes through `error_response`, including FastAPI's own
404/405, a body that fails its model (400, `validation_error`), and anything unexpected (500,
never a traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from areal_runtime.errors import (
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    ServiceError,
    error_for,
)

log = logging.getLogger(__name__)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "invalid_request",
    501: "not_implemented",
}


def error_body(err: ServiceError) -> bytes:
    return orjson.dumps(err.to_openai())


def error_response(err: ServiceError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(err), status_code=err.http_status, media_type="application/json", headers=headers
    )


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> InvalidRequest:
    return InvalidRequest(message, code=code, param=param)


# Pydantic's error types that mean "a value of the wrong kind" (the rest: a wrong value).
_WRONG_KIND = ("_type", "_parsing")


def validation_error(errors: Sequence[Any]) -> InvalidRequest:
    """A body that failed its model, as the 400 the hand-written checks answered before: the
    first problem, `param` the field's dotted path (`proxies.0.address`), `code`
    `missing_required_parameter`, `invalid_type`, `invalid_value`, or a validator's own."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc") or ()]
    param = ".".join(loc[1:]) or None  # loc[0] is "body", "path", ...
    kind = str(first.get("type") or "")
    msg = str(first.get("msg") or "invalid request").rstrip(".")
    if kind == "missing":
        return InvalidRequest(
            f"Missing required parameter: '{param}'.",
            code="missing_required_parameter",
            param=param,
        )
    if kind.endswith(_WRONG_KIND) or kind == "model_attributes_type":
        code = "invalid_type"
    elif kind.startswith(("invalid_", "duplicate_")):  # our validators' PydanticCustomError
        code = kind
    else:
        code = "invalid_value"
    message = f"Invalid '{param}': {msg}." if param else f"Invalid request body: {msg}."
    return InvalidRequest(message, code=code, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        # The rest of an oversized body is never read: the connection cannot be reused.
        headers = {"connection": "close"} if isinstance(exc, PayloadTooLarge) else {}
        if exc.retry_after_s:
            # A 429 of admission control (or any error that says when to come back).
            headers["retry-after"] = str(int(exc.retry_after_s))
        return error_response(exc, headers or None)

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        err = error_for(status, message, code=_HTTP_CODES.get(status))
        return error_response(err, dict(exc.headers) if exc.headers else None)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc.errors()))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error(
            "unhandled error on %s %s: %r", request.method, request.url.path, exc, exc_info=exc
        )
        return error_response(InternalError("Internal error in the gateway."))

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
