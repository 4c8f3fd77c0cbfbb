"""An agent-mode proxy serves AgentProxyService and ProxyStatusService, and nothing of the
inference half (the contract split of proto/areal/proxy/v1/proxy.proto)."""

from __future__ import annotations

import socket

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_agent_proxy.server import AgentProxyServer
from areal_agent_proxy.settings import Settings
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc


def _free_port() -> int:
    # A port nothing listens on: the worker is absent, so the proxy reports it unhealthy.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def agent_proxy():
    settings = Settings(
        worker_addr=f"127.0.0.1:{_free_port()}",
        metrics_port=-1,
        drain_timeout=0.5,
        proxy_id="bot-agent-proxy-0",
    )
    server = AgentProxyServer(settings)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, channel
    await channel.close()
    await server.shutdown()


async def test_agent_proxy_serves_status_and_health(agent_proxy):
    _, channel = agent_proxy
    stats = await proxy_pb2_grpc.ProxyStatusServiceStub(channel).GetStats(
        proxy_pb2.GetStatsRequest()
    )
    assert not stats.healthy and "agent worker" in stats.detail
    assert stats.sessions == 0 and stats.inflight_requests == 0
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "areal.proxy.v1.AgentProxyService", "areal.proxy.v1.ProxyStatusService"):
        r = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert r.status == health_pb2.HealthCheckResponse.SERVING


async def test_agent_proxy_answers_agent_rpcs(agent_proxy):
    _, channel = agent_proxy
    agent = proxy_pb2_grpc.AgentProxyServiceStub(channel)
    created = await agent.CreateAgentSession(
        proxy_pb2.CreateAgentSessionRequest(
            session_id="s1", session_api_key="k", metadata=orjson.dumps({})
        )
    )
    assert created.session_id == "s1"
    history = await agent.GetAgentHistory(proxy_pb2.GetAgentHistoryRequest(session_id="s1"))
    assert orjson.loads(history.history) == []
    # Not linked to an inference service: the agent reward is refused by the proxy itself.
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await agent.SetAgentReward(
            proxy_pb2.SetRewardRequest(
                session_id="s1", reward=1.0, envelope=envelope_pb2.Envelope(is_admin=True)
            )
        )
    assert ei.value.code() != grpc.StatusCode.UNIMPLEMENTED
    closed = await agent.CloseAgentSession(proxy_pb2.CloseAgentSessionRequest(session_id="s1"))
    assert closed.existed


async def test_inference_rpcs_are_not_served_in_agent_mode(agent_proxy):
    _, channel = agent_proxy
    inference = proxy_pb2_grpc.InferenceProxyServiceStub(channel)
    request = envelope_pb2.OpenAIRequest(envelope=envelope_pb2.Envelope(model="m"), body=b"{}")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await inference.ChatCompletion(request)
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await inference.Pause(proxy_pb2.PauseRequest())
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    call = inference.Generate()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call.read()
    assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
