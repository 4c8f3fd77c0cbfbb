"""OpenTelemetry tracing across the hops (docs/services.md, "Tracing (OpenTelemetry)").

Off unless the standard OTEL_* variables ask for it (`wanted`), and then only when the
`otel` extra is installed (`pip install 'areal-runtime[otel]'`). Each service calls
`setup("areal-<name>")` once at start; until then, and whenever tracing is off, every helper
here is a check of one module flag that returns a shared no-op (or its input unchanged), and
opentelemetry is never imported: the request path pays nothing for tracing it does not do.
What runs when it is on lives in tracing_sdk.py, imported only by `setup`.

Context crosses the hops as W3C trace context: HTTP headers at the gateway and to the
engine, gRPC metadata on every internal call (`metadata`), and, for generation, the
envelope's `trace_context` map (`carrier`), because one multiplexed Generate stream carries
many requests and so has no per-request metadata.

Identifiers (session, group, model, request, proxy) are span *attributes*, `areal.<name>`;
they are never metric labels (their number is unbounded).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

# Span kinds, as names: the SDK's enum is not imported while tracing is off.
INTERNAL = "internal"
SERVER = "server"
CLIENT = "client"

# The one flag every helper checks (set once by `setup`).
ON = False
_sdk: Any = None


class Span(Protocol):
    """What a `with tracing.span(...) as s` block holds: `s.set(...)` adds attributes."""

    def set(self, **attrs: Any) -> None: ...


class _NoopSpan:
    """What every span helper returns while tracing is off: nothing at all happens."""

    __slots__ = ()

    def set(self, **attrs: Any) -> None:
        pass

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NOOP = _NoopSpan()


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* variables ask for traces. OTEL_TRACES_EXPORTER=otlp (or console)
    turns tracing on, `none` turns it off; unset, an OTLP endpoint
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT) turns it on, since
    otlp is the exporter the specification defaults to. OTEL_SDK_DISABLED=true wins."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters(env)
    if exporters:
        return exporters != ["none"]
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _exporters(env: Mapping[str, str]) -> list[str]:
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    return [x.strip().lower() for x in raw.split(",") if x.strip()]


def setup(service: str, env: Mapping[str, str] | None = None, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when the environment asks for it; True if on.
    `service` names the process when OTEL_SERVICE_NAME does not. Missing packages or a
    configuration the SDK refuses are one warning here, never an error per request.
    `exporter` (tests: the SDK's in-memory exporter) turns it on whatever the environment
    says, each span exported as it ends."""
    global ON, _sdk
    env = os.environ if env is None else env
    if exporter is None and (ON or not wanted(env)):
        return ON
    try:
        from areal_runtime import tracing_sdk
    except ImportError as exc:
        log.warning(
            "tracing: OTEL_* variables ask for traces but OpenTelemetry is not installed "
            "(%s); running untraced. Install it with: pip install 'areal-runtime[otel]'",
            exc.name or exc,
        )
        return False
    try:
        tracing_sdk.install(service, _exporters(env) or ["otlp"], env, exporter)
    except Exception as exc:  # a bad OTEL_* value must not stop the service
        log.warning("tracing: could not start OpenTelemetry (%s); running untraced", exc)
        return False
    _sdk = tracing_sdk
    ON = True
    log.info("tracing: on (OpenTelemetry, service %s)", tracing_sdk.service_name(service, env))
    return True


def shutdown() -> None:
    """Flush and stop the exporter (services call it last; the SDK also does at exit)."""
    global ON, _sdk
    if ON:
        _sdk.shutdown()
    ON, _sdk = False, None


# ---- spans -----------------------------------------------------------------------------------


def span(
    name: str, *, kind: str = INTERNAL, parent: Any = None, **attrs: Any
) -> AbstractContextManager[Span]:
    """A span around a block, current inside it (children and outgoing calls join it).
    `parent`: a context from `parent_from` (None: the current span). Attributes become
    `areal.<name>`; None and "" values are left out."""
    if not ON:
        return NOOP
    result: AbstractContextManager[Span] = _sdk.span(name, kind, parent, attrs)
    return result


def stream_span(
    name: str, items: AsyncIterator[Any], *, kind: str = INTERNAL, **attrs: Any
) -> AsyncIterator[Any]:
    """`items` inside one span that lasts until the iteration ends. The span is current only
    while `items` produces its next item (an HTTP call made there carries it), never across
    a yield: the consumer's own spans stay where they are. Off: `items` itself."""
    if not ON:
        return items
    result: AsyncIterator[Any] = _sdk.stream_span(name, kind, items, attrs)
    return result


# ---- propagation -----------------------------------------------------------------------------


def parent_from(carrier: Mapping[str, str] | None) -> Any:
    """The remote parent in a carrier (a traceparent/tracestate mapping: HTTP headers, an
    envelope's trace_context), or None (no parent: the span starts a trace)."""
    if not ON or not carrier:
        return None
    return _sdk.extract(carrier)


def parent_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Any:
    """The client's trace context from raw ASGI headers (lower-case names)."""
    if not ON:
        return None
    found = {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in headers
        if k in (b"traceparent", b"tracestate")
    }
    return _sdk.extract(found) if found else None


def parent_from_metadata(context: Any) -> Any:
    """The caller's trace context from a gRPC servicer context's invocation metadata."""
    if not ON:
        return None
    return _sdk.extract(_metadata_dict(context.invocation_metadata()))


def metadata_carrier(context: Any) -> dict[str, str]:
    """The caller's trace context fields in a servicer context's metadata ({} when off)."""
    if not ON:
        return {}
    return _metadata_dict(context.invocation_metadata())


def _metadata_dict(metadata: Iterable[Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if key in ("traceparent", "tracestate") and isinstance(value, str):
            out[key] = value
    return out


def carrier() -> dict[str, str]:
    """The current span's context as W3C fields (empty when off or outside a span)."""
    if not ON:
        return {}
    result: dict[str, str] = _sdk.inject()
    return result


def metadata(md: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    """gRPC call metadata `md` with the current trace context added (off: `md` itself)."""
    if not ON:
        return md
    found = _sdk.inject()
    return (*md, *found.items()) if found else md


def inject_into(headers: Any) -> None:
    """Add the current trace context to a mutable mapping of outgoing HTTP headers (an
    aiohttp request's, in its on_request_start hook). Off: nothing."""
    if ON:
        _sdk.inject_into(headers)


_Servicer = TypeVar("_Servicer")
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def rpc(
    name: str,
    request_attrs: Callable[[Any], Mapping[str, Any]] | None = None,
    response_attrs: Callable[[Any], Mapping[str, Any]] | None = None,
) -> Callable[
    [Callable[[_Servicer, _Req, Any], Awaitable[_Resp]]],
    Callable[[_Servicer, _Req, Any], Awaitable[_Resp]],
]:
    """A unary gRPC servicer method as a SERVER span, child of the caller's context in the
    call's metadata, with attributes read from the request and the response. Off: the
    method runs as it is, one flag check added."""

    def wrap(
        fn: Callable[[_Servicer, _Req, Any], Awaitable[_Resp]],
    ) -> Callable[[_Servicer, _Req, Any], Awaitable[_Resp]]:
        @functools.wraps(fn)
        async def traced(self: _Servicer, request: _Req, context: Any) -> _Resp:
            if not ON:
                return await fn(self, request, context)
            attrs = request_attrs(request) if request_attrs is not None else {}
            with span(name, kind=SERVER, parent=parent_from_metadata(context), **attrs) as sp:
                response = await fn(self, request, context)
                if response_attrs is not None:
                    sp.set(**response_attrs(response))
                return response

        return traced

    return wrap
