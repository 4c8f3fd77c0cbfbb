"""The generated contract loads and round-trips (against areal-proto's own deps only)."""

from __future__ import annotations

from areal_proto.agent.v1 import agent_worker_pb2_grpc
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc


def test_envelope_round_trip():
    env = envelope_pb2.Envelope(
        request_id="r1", api_key="k", model="m", stream=True, deadline_unix_ms=123, session_id="s"
    )
    req = envelope_pb2.OpenAIRequest(envelope=env, body=b'{"messages": []}')
    back = envelope_pb2.OpenAIRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.envelope.deadline_unix_ms == 123
    assert back.body == b'{"messages": []}'


def test_services_declare_their_methods():
    proxy = proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"]
    names = {m.name for m in proxy.methods}
    assert {
        "ChatCompletion",
        "ChatCompletionStream",
        "ExportTrajectories",
        "Pause",
        "GetStats",
    } <= names
    assert proxy.methods_by_name["ChatCompletionStream"].server_streaming
    router = router_pb2.DESCRIPTOR.services_by_name["RouterService"]
    assert {"RegisterProxy", "Route", "BindSession", "ListModels"} <= {
        m.name for m in router.methods
    }
    assert hasattr(proxy_pb2_grpc, "ProxyServiceStub")
    assert hasattr(router_pb2_grpc, "add_RouterServiceServicer_to_server")
    assert hasattr(agent_worker_pb2_grpc, "AgentWorkerServiceStub")


def test_unknown_fields_survive_a_hop():
    # Additive growth: a newer sender's fields pass through an older reader.
    newer = router_pb2.ProxyInfo(proxy_id="p", address="127.0.0.1:1").SerializeToString()
    newer += b"\xa8\x06\x01"  # field 101, varint 1: unknown to this contract
    msg = router_pb2.ProxyInfo.FromString(newer)
    assert msg.proxy_id == "p"
    assert msg.SerializeToString() == newer
