"""The errors a service returns, by meaning, and their one mapping to HTTP and gRPC.

Every service raises one of these; the HTTP edge answers `to_openai()` with `http_status`, a gRPC
server aborts with `abort()` (status code + the `ErrorDetail` in trailing metadata
`areal-error-bin`), and a gRPC client turns the failure back with `from_rpc_error()`, which
rebuilds the same class: `except Draining:` works across a hop (docs/services.md, "Internal gRPC
calls"). Callers branch on the class, never on the `code` string or the status.

The hierarchy (status, OpenAI `type`, default `code`; `-` = none, sent as null):

    ServiceError                  any  (the base: a status with no class below, e.g. 405)
    ├── InvalidRequest            400  invalid_request_error  -
    │   ├── PayloadTooLarge       413  invalid_request_error  body_too_large
│   │                              (also body_too_complex)
    │   └── UnprocessableRequest  422  invalid_request_error  invalid_request
    ├── Unauthenticated           401  authentication_error   -
    ├── PermissionDenied          403  permission_error       -
    ├── NotFound                  404  not_found_error        -
    │   ├── UnknownModel          404  not_found_error        model_not_found
    │   └── SessionNotFound       404  not_found_error        session_not_found
    │       └── ReplicaDataLost   404  not_found_error        replica_data_lost
    ├── Conflict                  409  conflict_error         -
    │   ├── ModelExists           409  conflict_error         model_exists
    │   └── SessionExists         409  conflict_error         session_exists
    ├── Overloaded                429  rate_limit_error       -
    │   └── AdmissionRefused      429  rate_limit_error       capacity_exhausted
    │                                  (also staleness_bound)
    ├── Cancelled                 499  cancelled              client_closed
    ├── InternalError             500  api_error              internal_error
    │   └── AgentError            500  agent_error            agent_error
    ├── Unimplemented             501  not_implemented_error  not_implemented
    ├── UpstreamError             502  api_error              upstream_error
    │   └── InternalAuthFailed    502  api_error              internal_auth_failed
    ├── Unavailable               503  service_unavailable    -
    │   ├── Draining              503  service_unavailable    draining
    │   ├── NoHealthyReplica      503  service_unavailable    no_healthy_replica
    │   │                              (also no_healthy_proxy, no_healthy_pair)
    │   └── UpstreamUnavailable   503  service_unavailable    upstream_unavailable
    ├── DeadlineExceeded          504  timeout_error          deadline_exceeded
    │   └── UpstreamTimeout       504  timeout_error          upstream_timeout
    └── StorageFull               507  storage_error          storage_full

A class is built from a message alone (`Draining("this proxy is draining")`), with an optional
`param` and, for a more precise reason under the same meaning, a `code` (`NotFound(...,
code="group_not_found")`). A class with codes of its own (the leaves with a code above) takes
only those. Rebuilding from the wire picks the class by `code` first, then by status, and keeps
the wire's type, code and param as they were, so what a client finally sees is what the first
service raised. An error may say when a retry could succeed (`retry_after_s`, whole seconds):
it travels in the detail too, and the HTTP edge answers it as `Retry-After`.
"""

from __future__ import annotations

from typing import Any, ClassVar

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
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


class ServiceError(Exception):
    """An error a service returns to its caller, in OpenAI terms.

    Raise a subclass; the base is for a status no subclass names (and for code that predates
    them: `ServiceError(404, ...)` still works, but is not a `NotFound`)."""

    http_status: int = 500
    type: str = "api_error"
    code: str | None = None
    # The codes this class stands for, its default first. Empty: any code (a status class).
    codes: ClassVar[tuple[str, ...]] = ()
    # Seconds after which a retry may succeed (HTTP Retry-After); None = not said.
    retry_after_s: int | None = None

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
        self.type = type or _default_type(http_status)
        self.code = code
        self.param = param

    def to_openai(self) -> dict[str, Any]:
        """The HTTP body, `{"error": {...}}`, sent with `http_status`."""
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
            retry_after_s=self.retry_after_s or 0,
        )

    @staticmethod
    def from_detail(d: envelope_pb2.ErrorDetail) -> ServiceError:
        """The error an `ErrorDetail` describes, as the class that raised it."""
        err = error_for(
            d.http_status,
            d.message,
            type=d.type or None,
            code=d.code or None,
            param=d.param or None,
        )
        if d.retry_after_s > 0:
            err.retry_after_s = d.retry_after_s
        return err

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((ERROR_METADATA_KEY, self.detail().SerializeToString()),)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.http_status}, {self.message!r}, "
            f"type={self.type!r}, code={self.code!r})"
        )


class _Typed(ServiceError):
    """A subclass by meaning: status, type and default code come from the class."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        cls = type(self)
        if code is not None and cls.codes and code not in cls.codes:
            # A leaf means exactly its codes; another code would come back as another class.
            raise ValueError(f"{cls.__name__} takes code {' or '.join(cls.codes)}, not {code!r}")
        super().__init__(
            cls.http_status, message, type=cls.type, code=code or cls.code, param=param
        )


class InvalidRequest(_Typed):
    """The request is malformed or names something it may not (the caller's fault)."""

    http_status = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    """The body is over the size limit (or its structure over areal_runtime.bodycost's);
    the HTTP edge also closes the connection."""

    http_status = 413
    code = "body_too_large"
    # body_too_complex: a body within the size limit whose structure (JSON values) is not
    # (areal_runtime.bodycost).
    codes = ("body_too_large", "body_too_complex")


class UnprocessableRequest(InvalidRequest):
    """The body parsed but failed the schema (FastAPI's validation error)."""

    http_status = 422
    code = "invalid_request"
    codes = ("invalid_request",)


class Unauthenticated(_Typed):
    """No key, or a key nobody issued."""

    http_status = 401
    type = "authentication_error"


class PermissionDenied(_Typed):
    """A valid key that may not do this (needs the admin key, or another session's)."""

    http_status = 403
    type = "permission_error"


class NotFound(_Typed):
    """What the request names does not exist here."""

    http_status = 404
    type = "not_found_error"


class UnknownModel(NotFound):
    code = "model_not_found"
    codes = ("model_not_found",)


class SessionNotFound(NotFound):
    code = "session_not_found"
    codes = ("session_not_found",)


class ReplicaDataLost(SessionNotFound):
    """The session is unknown to a replica that was placed again on another node without
    the data it had recorded (no shared directory): never a silent short export."""

    code = "replica_data_lost"
    codes = ("replica_data_lost",)


class Conflict(_Typed):
    """The request is well-formed but the current state refuses it."""

    http_status = 409
    type = "conflict_error"


class ModelExists(Conflict):
    code = "model_exists"
    codes = ("model_exists",)


class SessionExists(Conflict):
    code = "session_exists"
    codes = ("session_exists",)


class Overloaded(_Typed):
    """Too much work right now; try again later."""

    http_status = 429
    type = "rate_limit_error"


class AdmissionRefused(Overloaded):
    """A model's admission bound refused a new session (docs/services.md, "Admission"):
    `capacity_exhausted` (max_concurrent_rollouts) or `staleness_bound` (max_staleness x
    batch_size at the current weight version). Carries `retry_after_s`."""

    code = "capacity_exhausted"
    codes = ("capacity_exhausted", "staleness_bound")

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int = 1,
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.retry_after_s = max(1, int(retry_after_s))


class Cancelled(_Typed):
    """The caller went away (HTTP client disconnected, gRPC call cancelled)."""

    http_status = 499
    type = "cancelled"
    code = "client_closed"
    codes = ("client_closed",)


class InternalError(_Typed):
    """A bug or an unexpected failure in this service."""

    http_status = 500
    type = "api_error"
    code = "internal_error"


class AgentError(InternalError):
    """The hosted agent's own code failed."""

    type = "agent_error"
    code = "agent_error"
    codes = ("agent_error",)


class Unimplemented(_Typed):
    http_status = 501
    type = "not_implemented_error"
    code = "not_implemented"
    codes = ("not_implemented",)


class UpstreamError(_Typed):
    """A service or engine this one called failed (bad gateway)."""

    http_status = 502
    type = "api_error"
    code = "upstream_error"


class InternalAuthFailed(UpstreamError):
    """A service this one called refused its internal token (AREAL_INTERNAL_TOKEN differs
    between them): the deployment is misconfigured, not the client. A 502, never the client
    401 it would read as "your key is wrong"."""

    code = "internal_auth_failed"
    codes = ("internal_auth_failed",)


class Unavailable(_Typed):
    """Cannot serve now; the same request may succeed later or elsewhere."""

    http_status = 503
    type = "service_unavailable"


class Draining(Unavailable):
    """This replica is shutting down and takes no new work; another replica may."""

    code = "draining"
    codes = ("draining",)


class NoHealthyReplica(Unavailable):
    """Nothing healthy serves the model (router: proxy; agent gateway: pair)."""

    code = "no_healthy_replica"
    codes = ("no_healthy_replica", "no_healthy_proxy", "no_healthy_pair")


class UpstreamUnavailable(Unavailable):
    """The service this one calls could not be reached."""

    code = "upstream_unavailable"
    codes = ("upstream_unavailable",)


class DeadlineExceeded(_Typed):
    """The request's deadline passed before the work finished."""

    http_status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


class UpstreamTimeout(DeadlineExceeded):
    """The service this one called did not answer before the deadline."""

    code = "upstream_timeout"
    codes = ("upstream_timeout",)


class StorageFull(_Typed):
    """This service's disk (or database) is full: nothing was written, and the same request
    succeeds once space is freed. 507 Insufficient Storage, not a 5xx that reads as a bug."""

    http_status = 507
    type = "storage_error"
    code = "storage_full"
    codes = ("storage_full",)


# Every class above, for rebuilding from the wire and for the tests.
ERROR_CLASSES: tuple[type[_Typed], ...] = (
    InvalidRequest,
    PayloadTooLarge,
    UnprocessableRequest,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    UnknownModel,
    SessionNotFound,
    ReplicaDataLost,
    Conflict,
    ModelExists,
    SessionExists,
    Overloaded,
    AdmissionRefused,
    Cancelled,
    InternalError,
    AgentError,
    Unimplemented,
    UpstreamError,
    InternalAuthFailed,
    Unavailable,
    Draining,
    NoHealthyReplica,
    UpstreamUnavailable,
    DeadlineExceeded,
    UpstreamTimeout,
    StorageFull,
)
_BY_CODE = {code: cls for cls in ERROR_CLASSES for code in cls.codes}
# The status classes: the first class listed for a status is the general one.
_BY_STATUS: dict[int, type[_Typed]] = {}
for _cls in ERROR_CLASSES:
    _BY_STATUS.setdefault(_cls.http_status, _cls)


def _default_type(http_status: int) -> str:
    cls = _BY_STATUS.get(http_status)
    if cls is not None:
        return cls.type
    return "api_error" if http_status >= 500 else "invalid_request_error"


def error_for(
    http_status: int,
    message: str,
    *,
    type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> ServiceError:
    """The error of that status and code as its class (by `code`, else by status, else the
    base), keeping exactly the given type and code: for what another service or an engine
    reported, so it reaches the client unchanged."""
    cls = _BY_CODE.get(code or "")
    if cls is None or cls.http_status != http_status:
        cls = _BY_STATUS.get(http_status)
    if cls is None:
        return ServiceError(http_status, message, type=type, code=code, param=param)
    err = cls(message, param=param)
    err.type = type or cls.type
    err.code = code  # what the wire said, even none, not the class default
    return err


async def abort(context: grpc.aio.ServicerContext, err: ServiceError) -> None:
    """Abort the current aio RPC with `err` (raises, as context.abort does)."""
    context.set_trailing_metadata(err.trailing_metadata())
    await context.abort(err.grpc_status(), err.message)


def from_rpc_error(exc: grpc.RpcError, *, target: str = "upstream") -> ServiceError:
    """Turn a failed gRPC call into the ServiceError subclass the server raised (the caller
    never sees grpc). A status without a detail (a transport failure, another server) maps
    by status: UNAVAILABLE is `UpstreamUnavailable`, DEADLINE_EXCEEDED `UpstreamTimeout`,
    UNAUTHENTICATED `InternalAuthFailed`, an unmapped status `UpstreamError`."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY:
            d = envelope_pb2.ErrorDetail.FromString(
                value if isinstance(value, bytes) else value.encode()
            )
            return ServiceError.from_detail(d)
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return UpstreamUnavailable(f"{target} unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"{target} did not answer before the deadline")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # Without a detail it is the callee's InternalTokenInterceptor refusing our token (a
        # caller's own key, refused by the service, always travels with its ErrorDetail).
        return InternalAuthFailed(
            f"{target} refused this service's internal token (internal authentication "
            f"failed: AREAL_INTERNAL_TOKEN differs between them): {details}"
        )
    status = _TO_HTTP.get(code)
    if status is None:
        return UpstreamError(f"{target} failed: {code.name}: {details}")
    return error_for(status, details or code.name)
