"""The servicer is composed of its RPC groups (serving/generate_rpcs.py, session_rpcs.py,
control_rpcs.py): every RPC of both services answers over a real socket from its group, none
falls through to the generated base's UNIMPLEMENTED; and the server hands each object its
collaborators at construction instead of editing its fields afterwards."""

from __future__ import annotations

import grpc
import pytest
from proxy_fakes import EOS, FakeEngineClient, start

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.serving.control_rpcs import ControlRpcs
from areal_proxy.serving.generate_rpcs import GenerateRpcs
from areal_proxy.serving.service import ProxyServicer
from areal_proxy.serving.session_rpcs import SessionRpcs

_SERVICES = ("InferenceProxyService", "ProxyStatusService")


def _methods() -> list[tuple[str, object]]:
    return [
        (f"/areal.proxy.v1.{svc}/{m.name}", m)
        for svc in _SERVICES
        for m in proxy_pb2.DESCRIPTOR.services_by_name[svc].methods
    ]


async def _call(channel: grpc.aio.Channel, path: str, method: object) -> None:
    """One call of `method` with an empty request, whatever its shape; a refusal is fine."""
    from google.protobuf import message_factory

    m: object = method
    req_cls = message_factory.GetMessageClass(m.input_type)  # type: ignore[attr-defined]
    out_cls = message_factory.GetMessageClass(m.output_type)  # type: ignore[attr-defined]
    ser, de = req_cls.SerializeToString, out_cls.FromString
    client_streaming = m.client_streaming  # type: ignore[attr-defined]
    server_streaming = m.server_streaming  # type: ignore[attr-defined]
    if client_streaming:
        call = channel.stream_stream(path, request_serializer=ser, response_deserializer=de)
        async for _ in call(iter(()), timeout=5):
            pass
    elif server_streaming:
        stream = channel.unary_stream(path, request_serializer=ser, response_deserializer=de)
        async for _ in stream(req_cls(), timeout=5):
            pass
    else:
        unary = channel.unary_unary(path, request_serializer=ser, response_deserializer=de)
        await unary(req_cls(), timeout=5)


async def test_every_rpc_answers_from_its_group() -> None:
    h = await start(FakeEngineClient([5, EOS]))
    try:
        methods = _methods()
        assert len(methods) > 15
        for path, method in methods:
            try:
                await _call(h.channel, path, method)
            except grpc.aio.AioRpcError as e:
                assert e.code() != grpc.StatusCode.UNIMPLEMENTED, path
    finally:
        await h.close()


@pytest.mark.parametrize(
    ("group", "names"),
    [
        (
            GenerateRpcs,
            [
                "ChatCompletion",
                "ChatCompletionStream",
                "Completion",
                "CompletionStream",
                "Generate",
                "CountTokens",
                "ContinueGeneration",
            ],
        ),
        (
            SessionRpcs,
            [
                "StartSessions",
                "EndSessions",
                "SetReward",
                "GetSession",
                "ExportTrajectories",
                "AckExport",
            ],
        ),
        (
            ControlRpcs,
            ["Pause", "Continue", "SetVersion", "UpdateWeights", "Retire", "GetStats"],
        ),
    ],
)
def test_each_rpc_lives_in_its_group(group: type, names: list[str]) -> None:
    for name in names:
        assert name in vars(group), name
        assert getattr(ProxyServicer, name) is vars(group)[name], name


async def test_collaborators_are_given_at_construction() -> None:
    h = await start(FakeEngineClient([5, EOS]))
    try:
        server = h.server
        assert server.controller.migrator is server.migrator
        assert server.servicer.on_retired == server._announce_retired
        reg = server.metrics.registry
        # The held-results gauge reads the servicer's streams (none open).
        assert reg.get_sample_value("areal_proxy_stream_held_results") == 0
        # The harness wraps the controller's on_finish; what it wraps is the metrics'.
        await h.chat({"messages": [{"role": "user", "content": "hi"}]})
        tokens = reg.get_sample_value(
            "areal_proxy_completion_tokens_total", {"model": "tiny-parrot"}
        )
        assert tokens == 2
    finally:
        await h.close()
