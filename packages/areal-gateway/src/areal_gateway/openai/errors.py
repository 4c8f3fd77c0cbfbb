"""OpenAI-shaped error responses: `{"error": {"message", "type", "code", "param"}}`.

Every error the gateway answers goes through `error_response`, including FastAPI's own
404/405/422 and anything unexpected (500, never a traceback).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from areal_runtime.errors import ServiceError

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
) -> ServiceError:
    return ServiceError(400, message, type="invalid_request_error", code=code, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        headers = {"connection": "close"} if exc.http_status == 413 else None
        return error_response(exc, headers)

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        err = ServiceError(status, message, code=_HTTP_CODES.get(status))
        return error_response(err, dict(exc.headers) if exc.headers else None)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors: Any = exc.errors()
        first = errors[0] if errors else {}
        loc = first.get("loc") or ()
        param = ".".join(str(p) for p in loc[1:]) or None
        message = str(first.get("msg") or "invalid request")
        return error_response(ServiceError(422, message, code="invalid_request", param=param))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error(
            "unhandled error on %s %s: %r", request.method, request.url.path, exc, exc_info=exc
        )
        return error_response(
            ServiceError(
                500, "Internal error in the gateway.", type="api_error", code="internal_error"
            )
        )

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
