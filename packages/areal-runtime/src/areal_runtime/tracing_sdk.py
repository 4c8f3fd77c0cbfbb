"""What tracing.py does when tracing is on: the OpenTelemetry SDK, set up from OTEL_*.

Imported only by `tracing.setup` once the environment asked for traces; nothing else
imports it, so a service that is not traced never loads opentelemetry. The provider is this
module's own (not the process-global one): a library in the same process that sets the
global provider neither changes nor is changed by the services' tracing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import SpanKind, Status, StatusCode

_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}

_provider: TracerProvider | None = None
_tracer: trace.Tracer = trace.NoOpTracer()


def service_name(service: str, env: Mapping[str, str]) -> str:
    return env.get("OTEL_SERVICE_NAME") or service


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    # Each exporter reads its endpoint, headers, timeout and compression from OTEL_* itself.
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported (http/protobuf or grpc)"
    )


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "otlp":
        return _otlp_exporter(env)
    if name == "console":
        return ConsoleSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported (otlp, console or none)")


def install(
    service: str,
    exporters: list[str],
    env: Mapping[str, str],
    exporter: SpanExporter | None = None,
) -> None:
    """A provider exporting to `exporters` (OTEL_TRACES_EXPORTER's values) in batches
    (OTEL_BSP_*), sampled as OTEL_TRACES_SAMPLER says; or, given `exporter` (tests), that one,
    span by span."""
    global _provider, _tracer
    resource = Resource.create(
        {"service.name": service_name(service, env), "areal.component": service}
    )
    # The SDK reads OTEL_TRACES_SAMPLER / _ARG when no sampler is given.
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        made = [_exporter(name, env) for name in exporters if name != "none"]
        for one in made:
            provider.add_span_processor(BatchSpanProcessor(one))
    if _provider is not None:
        _provider.shutdown()
    _provider = provider
    _tracer = provider.get_tracer("areal")


def shutdown() -> None:
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, trace.NoOpTracer()


def _attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {f"areal.{k}": v for k, v in attrs.items() if v is not None and v != ""}


class _Live:
    """A recording span as tracing.Span: `set` adds attributes."""

    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def set(self, **attrs: Any) -> None:
        self.span.set_attributes(_attrs(attrs))


class _Current:
    """A span current inside a `with` block (see tracing.span)."""

    __slots__ = ("_cm", "_span")

    def __init__(self, name: str, kind: str, parent: Any, attrs: Mapping[str, Any]) -> None:
        self._cm = _tracer.start_as_current_span(
            name, context=parent, kind=_KINDS[kind], attributes=_attrs(attrs)
        )

    def __enter__(self) -> _Live:
        return _Live(self._cm.__enter__())

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def set(self, **attrs: Any) -> None:  # pragma: no cover - callers use __enter__'s value
        raise TypeError("use the span `with` returns")


def span(name: str, kind: str, parent: Any, attrs: Mapping[str, Any]) -> _Current:
    return _Current(name, kind, parent, attrs)


async def stream_span(
    name: str, kind: str, items: AsyncIterator[Any], attrs: Mapping[str, Any]
) -> AsyncIterator[Any]:
    sp = _tracer.start_span(name, kind=_KINDS[kind], attributes=_attrs(attrs))
    ctx = trace.set_span_in_context(sp)
    count = 0
    try:
        while True:
            # Current while `items` works (its HTTP call carries the span), detached before
            # the item leaves: a context attached across a yield would be the consumer's.
            token = otel_context.attach(ctx)
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            count += 1
            yield item
    except Exception as exc:
        sp.record_exception(exc)
        sp.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        sp.set_attribute("areal.items", count)
        aclose = getattr(items, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            sp.end()


def extract(carrier: Mapping[str, str]) -> Any:
    return propagate.extract(carrier)


def inject() -> dict[str, str]:
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def inject_into(headers: Any) -> None:
    propagate.inject(headers)
