"""OpenTelemetry across the hops, through real processes: router, gateway and a proxy in front
of the real SGLang engine, started with only the standard OTEL_* variables pointing at a tiny
OTLP/HTTP receiver this test runs (decoding ExportTraceServiceRequest with opentelemetry-proto).

One RL group and one chat on its session key, each with the client's own `traceparent`: the
gateway's, the router's and the proxy's spans join the client's trace, form one tree under the
client's span, carry the session, group and model as attributes, and the proxy's engine call
is a span of its own (the engine's HTTP request carries it as `traceparent`; the proxy's unit
tests check that header).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from stack import start_stack
from testpaths import PARROT

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
GROUP_TRACE = "5cf92f3577b34da6a3ce929d0e0e4737"


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it was sent, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req: ExportTraceServiceRequest) -> None:
        found = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(
                        {
                            "service": resource.get("service.name"),
                            "name": s.name,
                            "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "kind": s.kind,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                        }
                    )
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 15) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.trace(trace_id)
            if names <= {s["name"] for s in got} or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory, receiver):
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        # Export within 0.1 s of a span's end (the SDK's default waits 5 s).
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    # The services inherit this process's environment, as the CLI's children do.
    with pytest.MonkeyPatch.context() as mp:
        for k, v in otel.items():
            mp.setenv(k, v)
        s = start_stack(tmp_path_factory.mktemp("tracing"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


def _tree(spans: list[dict[str, Any]], root_parent: str) -> None:
    """Every span's parent is another span of the trace, except one whose parent is the
    client's: one tree under the client's span."""
    ids = {s["id"] for s in spans}
    roots = [s for s in spans if s["parent"] not in ids]
    assert [r["parent"] for r in roots] == [root_parent], [(r["name"], r["parent"]) for r in roots]


def test_one_chat_is_one_trace_across_gateway_router_and_proxy(stack, receiver):
    with stack.admin() as admin:
        r = admin.post(
            "/rl/start_session",
            json={"model": MODEL, "group_size": 1},
            headers={"traceparent": f"00-{GROUP_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert r.status_code == 201, r.text
        group = r.json()
    session = group["sessions"][0]
    r = httpx.post(
        f"{stack.gateway_url}/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {session['session_api_key']}",
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "tracestate": "client=1",
        },
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text

    expected = {
        "gateway.request",
        "gateway.route",
        "gateway.proxy",
        "router.Route",
        "proxy.request",
        "proxy.prepare",
        "proxy.engine",
        "proxy.commit",
    }
    spans = receiver.wait_for(CLIENT_TRACE, expected)
    by_name = {s["name"]: s for s in spans}
    assert expected <= set(by_name), sorted(by_name)
    _tree(spans, CLIENT_SPAN)
    services = {s["name"]: s["service"] for s in spans}
    assert services["gateway.request"] == "areal-gateway"
    assert services["router.Route"] == "areal-router"
    assert services["proxy.engine"] == "areal-proxy"

    def parent(name: str) -> str:
        return next(s["name"] for s in spans if s["id"] == by_name[name]["parent"])

    assert by_name["gateway.request"]["parent"] == CLIENT_SPAN
    assert parent("router.Route") == "gateway.route"
    assert parent("proxy.request") == "gateway.proxy"
    assert parent("proxy.engine") == "proxy.request"
    sid = session["session_id"]
    for name in ("gateway.request", "router.Route", "proxy.request", "proxy.commit"):
        assert by_name[name]["attrs"]["areal.session_id"] == sid, name
    assert by_name["gateway.request"]["attrs"]["areal.model"] == MODEL
    assert by_name["router.Route"]["attrs"]["areal.proxy_id"]
    assert by_name["proxy.commit"]["attrs"]["areal.group_id"] == group["group_id"]
    engine = by_name["proxy.engine"]["attrs"]
    assert by_name["proxy.engine"]["kind"] == 3  # SPAN_KIND_CLIENT
    assert engine["areal.prompt_tokens"] > 0 and engine["areal.output_tokens"] > 0

    # The group's start joins its own client trace, the router's binding under it.
    bound = receiver.wait_for(GROUP_TRACE, {"gateway.start_session", "router.BindSession"})
    by_name = {s["name"]: s for s in bound}
    _tree(bound, CLIENT_SPAN)
    assert by_name["router.BindSession"]["attrs"]["areal.group_id"] == group["group_id"]
    assert by_name["gateway.start_session"]["attrs"]["areal.group_id"] == group["group_id"]
