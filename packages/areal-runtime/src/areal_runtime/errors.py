"""OpenAI-shaped errors carried over gRPC status (docs/services.md, "Internal gRPC calls")."""

from __future__ import annotations

from typing import Any

import grpc

from areal_proto.common.v1 import envelope_pb2

ERROR_METADATA_KEY = "areal-error-bin"

# HTTP status -> gRPC status, for raising; and back, for a status without a detail.
_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}
_DEFAULT_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout_error",
}


class ServiceError(Exception):
    """An error a service returns to its caller, in OpenAI terms."""

    def __init__(
        self,
        http_status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.message = message
        self.type = type or _DEFAULT_TYPE.get(
            http_status, "api_error" if http_status >= 500 else "invalid_request_error"
        )
        self.code = code
        self.param = param

    def to_openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def grpc_status(self) -> grpc.StatusCode:
        return _TO_GRPC.get(self.http_status, grpc.StatusCode.INTERNAL)

    def detail(self) -> envelope_pb2.ErrorDetail:
        return envelope_pb2.ErrorDetail(
            http_status=self.http_status,
            type=self.type,
            code=self.code or "",
            message=self.message,
            param=self.param or "",
        )

    @classmethod
    def from_detail(cls, d: envelope_pb2.ErrorDetail) -> ServiceError:
        return cls(
            d.http_status,
            d.message,
            type=d.type or None,
            code=d.code or None,
            param=d.param or None,
        )

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((ERROR_METADATA_KEY, self.detail().SerializeToString()),)

    def __repr__(self) -> str:
        return f"ServiceError({self.http_status}, {self.message!r}, type={self.type!r}, code={self.code!r})"


async def abort(context: grpc.aio.ServicerContext, err: ServiceError) -> None:
    """Abort the current aio RPC with `err` (raises, as context.abort does)."""
    context.set_trailing_metadata(err.trailing_metadata())
    await context.abort(err.grpc_status(), err.message)


def from_rpc_error(exc: grpc.RpcError, *, target: str = "upstream") -> ServiceError:
    """Turn a failed gRPC call into a ServiceError (the caller never sees grpc)."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY:
            d = envelope_pb2.ErrorDetail.FromString(
                value if isinstance(value, bytes) else value.encode()
            )
            return ServiceError.from_detail(d)
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    status = _TO_HTTP.get(code, 502)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServiceError(503, f"{target} unavailable: {details}", code="upstream_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServiceError(
            504, f"{target} did not answer before the deadline", code="upstream_timeout"
        )
    if status == 502:
        return ServiceError(
            502, f"{target} failed: {code.name}: {details}", type="api_error", code="upstream_error"
        )
    return ServiceError(status, details or code.name)
