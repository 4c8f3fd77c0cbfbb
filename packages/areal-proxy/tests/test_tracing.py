"""The engine call as a span, and its HTTP request carrying that span as `traceparent`, for
both engine clients, against a real aiohttp server standing in for the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.sglang import SGLangClient
from areal_proxy.engine.vllm import VLLMClient
from areal_proxy.generation.controller import GenerationController
from areal_runtime import tracing

CLIENTS = {"sglang": SGLangClient, "vllm": VLLMClient}
# The generation call of each (the vLLM client also asks for the weight version).
GENERATE_PATHS = ("/generate", "/v1/completions")


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """An engine that records each request's headers and refuses it (a 400: an answer about
    the request, so nothing is retried or migrated)."""
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        if request.path in GENERATE_PATHS:
            seen.append(dict(request.headers))
        return web.json_response({"error": {"message": "refused"}}, status=400)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.setup("areal-proxy-test", {}, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


async def _generate(client: Any, stream: bool) -> None:
    controller = GenerationController(client)
    rec = controller.start([1, 2, 3], 4)
    template = GenerationRequest([], 0)
    with pytest.raises(EngineError):
        if stream:
            async for _ in controller.stream(rec, template):
                pass
        else:
            await controller.generate(rec, template)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_engine_call_carries_its_span(
    kind: str, stream: bool, engine: tuple[str, list[dict[str, str]]], spans: InMemorySpanExporter
) -> None:
    url, seen = engine
    client = CLIENTS[kind](url, timeout=10)
    try:
        with tracing.span("proxy.request", kind=tracing.SERVER):
            await _generate(client, stream)
    finally:
        await client.close()
    by_name = {s.name: s for s in spans.get_finished_spans()}
    call, request = by_name["proxy.engine"], by_name["proxy.request"]
    assert call.kind == SpanKind.CLIENT
    assert call.parent is not None and call.parent.span_id == request.context.span_id
    assert not call.status.is_ok  # the engine refused it
    assert (call.attributes or {})["areal.prompt_tokens"] == 3
    (headers,) = seen
    expected = f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-"
    assert headers["traceparent"].startswith(expected)


@pytest.mark.parametrize("kind", CLIENTS)
async def test_untraced_the_engine_call_has_no_traceparent(
    kind: str, engine: tuple[str, list[dict[str, str]]]
) -> None:
    assert not tracing.ON
    url, seen = engine
    client = CLIENTS[kind](url, timeout=10)
    try:
        await _generate(client, False)
    finally:
        await client.close()
    (headers,) = seen
    assert "traceparent" not in {k.lower() for k in headers}
