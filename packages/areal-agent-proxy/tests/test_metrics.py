"""An agent-mode proxy counts its agent turns on /metrics: by outcome, latency, errors.

A stand-in agent worker (in this process) answers each turn with one delta and `done`, or
with an `error` event when the message says "boom".
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from areal_agent_proxy.server import AgentProxyServer
from areal_agent_proxy.settings import Settings
from areal_proto.agent.v1 import agent_worker_pb2, agent_worker_pb2_grpc
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc

N_OK = 5
N_FAILED = 2


class EchoWorker(agent_worker_pb2_grpc.AgentWorkerServiceServicer):
    async def RunTurn(  # type: ignore[override]
        self, request: agent_worker_pb2.RunTurnRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_worker_pb2.AgentEvent]:
        text = orjson.loads(request.message)
        if "boom" in text:
            yield agent_worker_pb2.AgentEvent(
                type="error", data=orjson.dumps({"message": "asked to fail"})
            )
            return
        yield agent_worker_pb2.AgentEvent(type="delta", data=orjson.dumps({"text": text}))
        yield agent_worker_pb2.AgentEvent(type="done", data=b"{}")

    async def CloseSession(  # type: ignore[override]
        self, request: agent_worker_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> agent_worker_pb2.CloseSessionResponse:
        return agent_worker_pb2.CloseSessionResponse()


@pytest.fixture
async def proxy():
    worker = grpc.aio.server()
    agent_worker_pb2_grpc.add_AgentWorkerServiceServicer_to_server(EchoWorker(), worker)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, worker)
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    await worker.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    server = AgentProxyServer(
        Settings(
            worker_addr=f"127.0.0.1:{worker_port}",
            metrics_port=0,
            drain_timeout=0.5,
            proxy_id="p0",
        )
    )
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, proxy_pb2_grpc.AgentProxyServiceStub(channel)
    await channel.close()
    await server.shutdown()
    await worker.stop(None)


def _turn(session_id: str, text: str) -> proxy_pb2.AgentTurnRequest:
    return proxy_pb2.AgentTurnRequest(
        envelope=envelope_pb2.Envelope(is_admin=True, session_id=session_id),
        session_id=session_id,
        message=orjson.dumps(text),
        metadata=b"{}",
    )


async def _scrape(server: AgentProxyServer) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+) (\S+)$", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


async def test_agent_turns_are_counted_by_outcome(proxy) -> None:
    server, stub = proxy
    for i in range(N_OK):
        events = [ev.type async for ev in stub.AgentTurn(_turn("s1", f"hi {i}"))]
        assert events == ["delta", "done"]
    for _ in range(N_FAILED):
        events = [ev.type async for ev in stub.AgentTurn(_turn("s1", "boom"))]
        assert events == ["error"]
    # A non-admin turn on a session that does not exist: refused before it runs.
    missing = _turn("nope", "hi")
    missing.envelope.is_admin = False
    with pytest.raises(grpc.aio.AioRpcError):
        _ = [ev async for ev in stub.AgentTurn(missing)]

    m = await _scrape(server)
    assert m['areal_proxy_agent_turns_total{outcome="ok"}'] == N_OK
    assert m['areal_proxy_agent_turns_total{outcome="error"}'] == N_FAILED + 1
    assert m['areal_proxy_agent_turns_total{outcome="cancelled"}'] == 0
    assert m['areal_proxy_agent_turn_seconds_count{outcome="ok"}'] == N_OK
    assert m['areal_proxy_agent_turn_seconds_sum{outcome="ok"}'] > 0
    assert m['areal_proxy_agent_errors_total{code="agent_error"}'] == N_FAILED
    assert m['areal_proxy_agent_errors_total{code="session_not_found"}'] == 1
    assert m["areal_proxy_agent_running_turns"] == 0
    assert m["areal_proxy_agent_sessions"] == 1
    assert m["areal_proxy_agent_worker_healthy"] == 1
    # The inference metrics, which no agent turn moves, are not exported here.
    assert not any(k.startswith("areal_proxy_requests_total") for k in m)
    # GetStats (what the router reads) counts the turns that ran.
    stats = await server.servicer.GetStats(proxy_pb2.GetStatsRequest(), None)  # type: ignore[arg-type]
    assert stats.total_requests == N_OK + N_FAILED and stats.inflight_requests == 0
