"""One error hierarchy for everything the client can fail with.

    ArealClientError
    ├── APIConnectionError          the gateway could not be reached (or the connection broke)
    │   └── APITimeoutError         no answer within the client's timeout
    ├── APIStatusError              the gateway answered 4xx/5xx: .status, .code, .type, .message
    │   ├── BadRequestError         400
    │   ├── AuthenticationError     401
    │   ├── PermissionDeniedError   403
    │   ├── NotFoundError           404
    │   ├── ConflictError           409
    │   ├── RateLimitError          429
    │   ├── InternalServerError     >= 500
    │   └── PartialFailureError     207 from a control call: some workers failed (.result)
    ├── ExportInterruptedError      an NDJSON export failed after rows were sent
    └── InvalidResponseError        a 2xx answer that is not the documented shape

The gateway answers errors OpenAI-style (`{"error": {"message", "type", "code", "param"}}`);
`APIStatusError` carries those fields as they came, so a caller can branch on `code`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_client.types import ControlResult


class ArealClientError(Exception):
    """Base of every error this package raises (bad arguments raise ValueError instead)."""


class APIConnectionError(ArealClientError):
    def __init__(self, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: {message}" if method else message)
        self.message = message
        self.method = method
        self.path = path


class APITimeoutError(APIConnectionError):
    pass


class APIStatusError(ArealClientError):
    """The gateway answered with an error status; fields are the gateway's OpenAI error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        method: str = "",
        path: str = "",
        body: Any = None,
    ) -> None:
        where = f"{method} {path}: " if method else ""
        tail = f" ({code})" if code else ""
        super().__init__(f"{where}HTTP {status}: {message}{tail}")
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param
        self.method = method
        self.path = path
        self.body = body


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    """429: e.g. the model's admission bounds refused a start (`code`
    `capacity_exhausted` or `staleness_bound`). `retry_after` is the answer's Retry-After
    in seconds (None when it said none)."""

    retry_after: float | None = None


class InternalServerError(APIStatusError):
    pass


class PartialFailureError(APIStatusError):
    """A pause/continue/set_version/update_weights reached only some workers.

    Raised rather than returned: a trainer that goes on after a partial weight update
    would sample from engines holding different weights. `result` has every worker's
    outcome, so a caller that can live with it may read it and continue.
    """

    def __init__(self, result: ControlResult, *, method: str = "", path: str = "") -> None:
        failed = [w for w in result.workers if w.error is not None]
        message = "; ".join(f"{w.proxy_id}: {w.error}" for w in failed)
        super().__init__(
            207,
            f"{len(failed)} of {len(result.workers)} workers failed: {message}",
            code="partial_failure",
            method=method,
            path=path,
        )
        self.result = result


class ExportInterruptedError(ArealClientError):
    """An NDJSON export failed part-way (the gateway sent an error line after some rows)."""

    def __init__(
        self, message: str, *, code: str | None = None, type: str | None = None, rows_read: int = 0
    ) -> None:
        super().__init__(f"export interrupted after {rows_read} rows: {message}")
        self.message = message
        self.code = code
        self.type = type
        self.rows_read = rows_read


class ExportNotAcknowledgedError(ArealClientError):
    """An export with `remove_session` was received whole, but its acknowledgement failed,
    so its sessions are not removed (yet). Nothing is lost: `result` holds the rows (None
    after `iter_export`, which yielded them), and `ack_export(export_id)` may be retried; a
    new export also returns every row not removed."""

    def __init__(self, message: str, *, export_id: str, result: Any = None) -> None:
        super().__init__(f"export {export_id} not acknowledged: {message}")
        self.export_id = export_id
        self.result = result


class InvalidResponseError(ArealClientError):
    """The gateway's answer was not what its API documents (a version mismatch, a proxy)."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    429: RateLimitError,
}


def status_error(
    status: int, raw: bytes, *, method: str = "", path: str = "", retry_after: str | None = None
) -> APIStatusError:
    """The typed error for an error answer, with the gateway's message when it sent one."""
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        code, typ, param = err.get("code"), err.get("type"), err.get("param")
    else:
        message, code, typ, param = "", None, None, None
        workers = body.get("workers") if isinstance(body, dict) else None
        if isinstance(workers, list):
            # A control call every worker failed: the body lists each worker's error.
            message = "; ".join(
                f"{w.get('proxy_id', '?')}: {w.get('error', '')}"
                for w in workers
                if isinstance(w, dict) and w.get("error")
            )
    if not message:
        # Not the gateway's error shape (an HTTP proxy in between, a crash page): show it.
        message = " ".join(raw.decode("utf-8", "replace").split())[:300] or "(empty body)"
    cls = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    out = cls(
        status,
        message,
        code=str(code) if code else None,
        type=str(typ) if typ else None,
        param=str(param) if param else None,
        method=method,
        path=path,
        body=body,
    )
    if isinstance(out, RateLimitError) and retry_after:
        try:
            out.retry_after = max(0.0, float(retry_after))
        except ValueError:
            pass  # an HTTP date: not what the gateway sends; retry on the caller's cadence
    return out
