"""tracing.py: off by default and free, on from OTEL_*, spans with areal.* attributes, context
across a real in-process gRPC hop and into outgoing headers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime import tracing

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.setup("areal-test", {}, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


# ---- off -------------------------------------------------------------------------------------


def test_off_by_default_every_helper_is_a_no_op() -> None:
    assert not tracing.ON
    assert tracing.span("x", a=1) is tracing.NOOP
    with tracing.span("x") as sp:
        sp.set(b=2)
    md = (("x-areal-internal-token", "t"),)
    assert tracing.metadata(md) is md
    assert tracing.carrier() == {}
    assert tracing.parent_from({"traceparent": TRACEPARENT}) is None
    assert tracing.parent_from_headers([(b"traceparent", TRACEPARENT.encode())]) is None

    async def gen() -> AsyncIterator[int]:
        yield 1

    items = gen()
    assert tracing.stream_span("x", items) is items


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        (
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
            False,
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_SERVICE_NAME": "areal"}, False),
    ],
)
def test_wanted_reads_the_standard_variables(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


_PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from areal_runtime import tracing
on = tracing.setup("areal-probe")
with tracing.span("x", a=1):
    pass
tracing.metadata(())
print(json.dumps({"on": on,
    "otel": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")}))
"""


def _probe(env: dict[str, str], prelude: str = "") -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-c", prelude + _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout), done.stderr


def test_off_never_imports_opentelemetry() -> None:
    out, _ = _probe(_clean_env())
    assert out == {"on": False, "otel": []}


def test_on_from_env_imports_and_installs_the_sdk() -> None:
    env = _clean_env() | {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_BSP_SCHEDULE_DELAY": "60000",
    }
    out, _ = _probe(env)
    assert out["on"] is True
    assert "opentelemetry.sdk.trace" in out["otel"]


def test_missing_packages_are_one_warning_and_untraced() -> None:
    env = _clean_env() | {"OTEL_TRACES_EXPORTER": "otlp"}
    # As if the `otel` extra were not installed: importing opentelemetry fails.
    blocked = "import sys\nsys.modules['opentelemetry'] = None\n"
    out, err = _probe(env, blocked)
    assert out["on"] is False
    warnings = [line for line in err.splitlines() if "tracing:" in line]
    assert len(warnings) == 1, err
    assert "pip install 'areal-runtime[otel]'" in warnings[0]


def test_a_bad_protocol_is_a_warning_not_a_crash() -> None:
    env = _clean_env() | {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier"}
    out, err = _probe(env)
    assert out["on"] is False
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='carrier' is not supported" in err


# ---- on --------------------------------------------------------------------------------------


def test_spans_carry_areal_attributes_and_nest(spans: InMemorySpanExporter) -> None:
    with tracing.span("outer", kind=tracing.SERVER, session_id="sess-1", model="m") as sp:
        sp.set(proxy_id="p0", empty="", none=None)
        with tracing.span("inner", group_id="group-1"):
            pass
    inner, outer = spans.get_finished_spans()
    assert outer.name == "outer" and outer.kind == SpanKind.SERVER
    assert dict(outer.attributes or {}) == {
        "areal.session_id": "sess-1",
        "areal.model": "m",
        "areal.proxy_id": "p0",
    }
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert inner.context.trace_id == outer.context.trace_id
    assert (inner.attributes or {})["areal.group_id"] == "group-1"
    assert outer.resource.attributes["service.name"] == "areal-test"


def test_a_client_traceparent_is_honoured(spans: InMemorySpanExporter) -> None:
    parent = tracing.parent_from_headers(
        [(b"content-type", b"application/json"), (b"traceparent", TRACEPARENT.encode())]
    )
    with tracing.span("gateway.request", kind=tracing.SERVER, parent=parent):
        carried = tracing.carrier()
    (done,) = spans.get_finished_spans()
    assert format(done.context.trace_id, "032x") == CLIENT_TRACE
    assert done.parent is not None and format(done.parent.span_id, "016x") == CLIENT_SPAN
    # What goes on to the next hop names this span, in the client's trace.
    assert carried["traceparent"].startswith(f"00-{CLIENT_TRACE}-{done.context.span_id:016x}-")


def test_an_exception_marks_the_span(spans: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError), tracing.span("boom"):
        raise ValueError("bad")
    (done,) = spans.get_finished_spans()
    assert not done.status.is_ok


class _Router(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.seen: list[str] = []

    @tracing.rpc(
        "router.Route",
        lambda r: {"model": r.model, "session_id": r.session_id},
        lambda r: {"proxy_id": r.proxy_id},
    )
    async def Route(self, request: Any, context: Any) -> router_pb2.RouteResponse:
        # The handler runs inside the server span: its own spans are children of it.
        with tracing.span("router.decide"):
            self.seen.append(tracing.carrier().get("traceparent", ""))
        return router_pb2.RouteResponse(proxy_id="proxy-7", address="127.0.0.1:1")


async def test_context_crosses_a_grpc_hop_in_metadata(spans: InMemorySpanExporter) -> None:
    server = grpc.aio.server()
    servicer = _Router()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            with tracing.span("gateway.route", kind=tracing.CLIENT):
                md = tracing.metadata((("x-areal-internal-token", "t"),))
                await stub.Route(router_pb2.RouteRequest(model="m", session_id="s1"), metadata=md)
    finally:
        await server.stop(None)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    client, server_span, inner = (
        by_name["gateway.route"],
        by_name["router.Route"],
        by_name["router.decide"],
    )
    assert server_span.kind == SpanKind.SERVER
    assert server_span.parent is not None and server_span.parent.span_id == client.context.span_id
    assert inner.parent is not None and inner.parent.span_id == server_span.context.span_id
    assert {s.context.trace_id for s in by_name.values()} == {client.context.trace_id}
    attrs = dict(server_span.attributes or {})
    assert attrs["areal.model"] == "m"
    assert attrs["areal.session_id"] == "s1"
    assert attrs["areal.proxy_id"] == "proxy-7"


async def test_stream_span_is_current_only_while_the_source_works(
    spans: InMemorySpanExporter,
) -> None:
    seen: list[str] = []

    async def engine() -> AsyncIterator[int]:
        for i in range(3):
            # The engine call's HTTP request would carry this (transport.trace_configs).
            headers: dict[str, str] = {}
            tracing.inject_into(headers)
            seen.append(headers["traceparent"])
            await asyncio.sleep(0)
            yield i

    with tracing.span("proxy.request"):
        got = []
        async for item in tracing.stream_span("proxy.engine", engine(), kind=tracing.CLIENT):
            # The consumer's spans stay the request's children, not the engine call's.
            with tracing.span("proxy.step"):
                got.append(item)
    assert got == [0, 1, 2]
    by_name: dict[str, list[Any]] = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    (request,) = by_name["proxy.request"]
    (engine_span,) = by_name["proxy.engine"]
    assert engine_span.parent.span_id == request.context.span_id
    assert (engine_span.attributes or {})["areal.items"] == 3
    assert all(s.parent.span_id == request.context.span_id for s in by_name["proxy.step"])
    expected = f"00-{request.context.trace_id:032x}-{engine_span.context.span_id:016x}-"
    assert len(set(seen)) == 1 and seen[0].startswith(expected)


async def test_stream_span_records_a_failure(spans: InMemorySpanExporter) -> None:
    async def engine() -> AsyncIterator[int]:
        yield 1
        raise RuntimeError("engine lost")

    with pytest.raises(RuntimeError):
        async for _ in tracing.stream_span("proxy.engine", engine()):
            pass
    (done,) = spans.get_finished_spans()
    assert not done.status.is_ok
