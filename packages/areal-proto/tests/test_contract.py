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


# What each proxy mode serves (proto/areal/proxy/v1/proxy.proto): the exact method sets, so
# a method added to or moved between services is a deliberate contract change.
INFERENCE_PROXY = {
    "ChatCompletion",
    "ChatCompletionStream",
    "Completion",
    "CompletionStream",
    "Generate",
    "CountTokens",
    "StartSessions",
    "EndSessions",
    "SetReward",
    "GetSession",
    "ExportTrajectories",
    "AckExport",
    "Pause",
    "Continue",
    "SetVersion",
    "UpdateWeights",
    "ContinueGeneration",
    "Retire",
}
AGENT_PROXY = {
    "CreateAgentSession",
    "AgentTurn",
    "CloseAgentSession",
    "GetAgentHistory",
    "SetAgentReward",
    "ExportAgentTrajectories",
    "AckAgentExport",
}
PROXY_STATUS = {"GetStats"}


def _methods(service: str) -> set[str]:
    return {m.name for m in proxy_pb2.DESCRIPTOR.services_by_name[service].methods}


def test_proxy_services_declare_exactly_their_methods():
    assert set(proxy_pb2.DESCRIPTOR.services_by_name) == {
        "InferenceProxyService",
        "AgentProxyService",
        "ProxyStatusService",
    }
    assert _methods("InferenceProxyService") == INFERENCE_PROXY
    assert _methods("AgentProxyService") == AGENT_PROXY
    assert _methods("ProxyStatusService") == PROXY_STATUS


def test_no_proxy_method_is_in_two_services():
    inference, agent = _methods("InferenceProxyService"), _methods("AgentProxyService")
    status = _methods("ProxyStatusService")
    assert not inference & agent
    assert not (inference | agent) & status


def test_proxy_streaming_shapes():
    inference = proxy_pb2.DESCRIPTOR.services_by_name["InferenceProxyService"]
    agent = proxy_pb2.DESCRIPTOR.services_by_name["AgentProxyService"]
    streamed = {m.name for m in inference.methods if m.server_streaming}
    assert streamed == {
        "ChatCompletionStream",
        "CompletionStream",
        "Generate",
        "ExportTrajectories",
        "ContinueGeneration",
    }
    assert not inference.methods_by_name["ContinueGeneration"].client_streaming
    generate = inference.methods_by_name["Generate"]
    assert generate.client_streaming and generate.server_streaming
    assert {m.name for m in agent.methods if m.server_streaming} == {
        "AgentTurn",
        "ExportAgentTrajectories",
    }
    # The agent service's reward and export take the inference service's messages.
    assert (
        agent.methods_by_name["SetAgentReward"].input_type
        is inference.methods_by_name["SetReward"].input_type
    )
    assert (
        agent.methods_by_name["ExportAgentTrajectories"].output_type
        is inference.methods_by_name["ExportTrajectories"].output_type
    )
    assert (
        agent.methods_by_name["AckAgentExport"].output_type
        is inference.methods_by_name["AckExport"].output_type
    )


def test_services_declare_their_methods():
    router = router_pb2.DESCRIPTOR.services_by_name["RouterService"]
    assert {"RegisterProxy", "Route", "BindSession", "ListModels"} <= {
        m.name for m in router.methods
    }
    for name in ("InferenceProxyService", "AgentProxyService", "ProxyStatusService"):
        assert hasattr(proxy_pb2_grpc, f"{name}Stub")
        assert hasattr(proxy_pb2_grpc, f"add_{name}Servicer_to_server")
    assert not hasattr(proxy_pb2_grpc, "ProxyServiceStub")
    assert hasattr(router_pb2_grpc, "add_RouterServiceServicer_to_server")
    assert hasattr(agent_worker_pb2_grpc, "AgentWorkerServiceStub")


def test_unknown_fields_survive_a_hop():
    # Additive growth: a newer sender's fields pass through an older reader.
    newer = router_pb2.ProxyInfo(proxy_id="p", address="127.0.0.1:1").SerializeToString()
    newer += b"\xa8\x06\x01"  # field 101, varint 1: unknown to this contract
    msg = router_pb2.ProxyInfo.FromString(newer)
    assert msg.proxy_id == "p"
    assert msg.SerializeToString() == newer
