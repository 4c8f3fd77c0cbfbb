"""Which failed generation may go to another replica: decided by what was sent
and the status code, never by grpc's wording of the error.

A request may go elsewhere only when it never reached the proxy. The gateway used to decide
that by matching "failed to connect" / "connection refused" in the error text, so a proxy
that had accepted a request and then failed with such words (its own connection to the
engine, say) had the request run again elsewhere, and a proxy that refused its stream in
other words was not retried although nothing had been sent.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from conftest import free_port

from areal_gateway.clients import ProxyPool, ProxyUnreachable
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2_grpc
from areal_runtime.errors import ServiceError

# What grpc itself says when it cannot connect: a proxy saying it after taking the request
# must not be read as "never delivered".
CONNECT_WORDS = "failed to connect to all addresses; connection refused"


def _request() -> envelope_pb2.OpenAIRequest:
    return envelope_pb2.OpenAIRequest(
        envelope=envelope_pb2.Envelope(request_id="r", model="m"), body=b"{}"
    )


class AcceptsThenFails(proxy_pb2_grpc.InferenceProxyServiceServicer):
    """Takes each request (counted), then fails it UNAVAILABLE in grpc's connect words."""

    def __init__(self) -> None:
        self.calls = 0
        self.frames = 0

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, CONNECT_WORDS)

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, CONNECT_WORDS)
        yield  # pragma: no cover

    async def Generate(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await context.send_initial_metadata(())
        async for msg in request_iterator:
            self.frames += len(msg.frames)
            await context.abort(grpc.StatusCode.UNAVAILABLE, CONNECT_WORDS)
        yield  # pragma: no cover


class RefusesStreams(proxy_pb2_grpc.InferenceProxyServiceServicer):
    """Ends each Generate stream UNAVAILABLE before it opens, in words grpc never uses."""

    async def Generate(self, request_iterator: Any, context: Any) -> Any:  # type: ignore[override]
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not taking streams right now")
        yield  # pragma: no cover


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("streams", [True, False])
async def test_a_proxy_that_is_down_is_unreachable(streams: bool) -> None:
    pool = ProxyPool("", streams=streams)
    try:
        client = pool.get(f"127.0.0.1:{free_port()}")
        with pytest.raises(ProxyUnreachable):
            await client.chat_completion(_request(), 5)
        with pytest.raises(ProxyUnreachable):
            async for _ in client.chat_completion_stream(_request(), 5):
                pass
    finally:
        await pool.close()


@pytest.mark.parametrize("streams", [True, False])
async def test_a_proxy_that_took_the_request_and_failed_is_not_retried(streams: bool) -> None:
    fake = AcceptsThenFails()
    server, address = await _serve(fake)
    pool = ProxyPool("", streams=streams)
    try:
        with pytest.raises(ServiceError) as ei:
            await pool.get(address).chat_completion(_request(), 5)
        assert not isinstance(ei.value, ProxyUnreachable), ei.value
        assert ei.value.http_status == 502
        if streams:
            assert fake.frames == 1
        else:
            with pytest.raises(ServiceError) as ei:
                async for _ in pool.get(address).chat_completion_stream(_request(), 5):
                    pass
            assert not isinstance(ei.value, ProxyUnreachable) and ei.value.http_status == 502
            assert fake.calls == 2
    finally:
        await pool.close()
        await server.stop(0)


async def test_a_stream_refused_before_it_opened_may_go_elsewhere() -> None:
    # Nothing was written (frames wait for the stream's initial metadata), whatever words
    # the refusal came in.
    server, address = await _serve(RefusesStreams())
    pool = ProxyPool("")
    try:
        with pytest.raises(ProxyUnreachable):
            await pool.get(address).chat_completion(_request(), 5)
    finally:
        await pool.close()
        await server.stop(0)
