"""InferenceLink (agent mode's link to an inference service) against a fake inference gateway
over real HTTP: what it sends with which key, what it returns, and how failures become
ServiceErrors the agent servicer can abort with."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web

from areal_agent_proxy.inference_link import InferenceLink
from areal_agent_proxy.server import AgentProxyServer
from areal_agent_proxy.settings import Settings
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.errors import (
    AdmissionRefused,
    InvalidRequest,
    ServiceError,
    SessionNotFound,
    Unavailable,
    UpstreamError,
)

ADMIN = "inf-admin-key"
KEY = "areal-sk-sess-abc.secret"
ROW = {
    "session_id": "sess-abc",
    "group_id": "group-1",
    "task_id": "agent-1",
    "interaction_id": "chatcmpl-1",
    "reward": 1.0,
    "finish_reason": "stop",
    "input_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "logprobs": [0.0, -0.1, -0.2],
    "versions": [-1, 0, 0],
    "interaction_ids": ["chatcmpl-1"],
    "response_id": "chatcmpl-1",
    "choice_index": 0,
    "replicas": [[1, "p0"]],
    "chain_id": "chatcmpl-1",
    "chain_reason": "root",
    "parent_chain": "",
    "side": False,
    "spans": [[1, 3, ""]],
    "tool_calls": {"declared": 0, "called": 0, "parsed": 0},
    "min_version": 0,
    "max_version": 0,
    "staleness": 0,
    "stale": False,
    "failure": "",
    "future_field": {"kept": True},
}


class FakeInferenceGateway:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []  # (path, bearer, body)
        self.fail: tuple[int, dict[str, Any] | str] | None = None
        self.fail_headers: dict[str, str] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.seen.append((request.path, bearer, body))
        if self.fail is not None:
            status, doc = self.fail
            if isinstance(doc, str):
                return web.Response(status=status, text=doc)
            return web.json_response(doc, status=status, headers=self.fail_headers)
        answers: dict[str, tuple[int, Any]] = {
            "/rl/start_session": (
                201,
                {
                    "group_id": "group-1",
                    "task_id": body.get("task_id", ""),
                    "model": body.get("model", "tiny"),
                    "sessions": [{"session_id": "sess-abc", "session_api_key": KEY}],
                },
            ),
            "/rl/set_reward": (
                200,
                {
                    "session_id": "sess-abc",
                    "interaction_id": "chatcmpl-1",
                    "reward": body.get("reward"),
                },
            ),
            "/rl/export_trajectories": (
                200,
                {"count": 1, "rows": [ROW]}
                | ({"export_id": "exp-1.x"} if body.get("remove_session") else {}),
            ),
            "/rl/ack_export": (
                200,
                {"export_id": body.get("export_id"), "removed": ["sess-abc"], "kept": []},
            ),
            "/rl/end_session": (200, {"ended": 1}),
        }
        status, doc = answers[request.path]
        return web.json_response(doc, status=status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        return app


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeInferenceGateway, InferenceLink]]:
    fake = FakeInferenceGateway()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    link = InferenceLink(f"http://127.0.0.1:{port}/", ADMIN, model="tiny")
    try:
        yield fake, link
    finally:
        await link.close()
        await runner.cleanup()


async def test_session_reward_export_end_use_the_right_keys(served) -> None:
    fake, link = served
    assert link.base_url.endswith("/v1") and not link.gateway_url.endswith("/")
    assert await link.start_session("agent-1") == ("sess-abc", KEY)
    out = await link.set_reward(KEY, 0.5, "chatcmpl-1")
    assert out == {"session_id": "sess-abc", "interaction_id": "chatcmpl-1", "reward": 0.5}
    rows, export_id = await link.export("sess-abc", "concat", 0.9, True)
    assert rows == [ROW]  # as the gateway sent it, unknown fields too
    # Not acknowledged: the rows have yet to reach the agent gateway's client.
    assert export_id == "exp-1.x" and fake.seen[-1][0] == "/rl/export_trajectories"
    ack = await link.ack_export(KEY, export_id)
    assert (ack.removed, ack.kept) == (["sess-abc"], [])
    await link.end_session(KEY)
    assert fake.seen == [
        ("/rl/start_session", ADMIN, {"task_id": "agent-1", "group_size": 1, "model": "tiny"}),
        ("/rl/set_reward", KEY, {"reward": 0.5, "interaction_id": "chatcmpl-1"}),
        (
            "/rl/export_trajectories",
            ADMIN,
            {
                "session_ids": ["sess-abc"],
                "style": "concat",
                "side_calls": "include",
                "discount": 0.9,
                "remove_session": True,
            },
        ),
        # Acknowledged only when asked, with the RL session's key: it removes only that session.
        ("/rl/ack_export", KEY, {"export_id": "exp-1.x"}),
        ("/rl/end_session", KEY, {}),
    ]


async def test_gateway_errors_keep_their_code_and_a_5xx_is_502(served) -> None:
    fake, link = served
    fake.fail = (
        404,
        {
            "error": {
                "message": "no session 'x'",
                "type": "not_found_error",
                "code": "session_not_found",
            }
        },
    )
    with pytest.raises(SessionNotFound) as info:  # the gateway's error keeps its class
        await link.set_reward(KEY, 1.0)
    e = info.value
    assert (e.http_status, e.code) == (404, "session_not_found")
    assert e.message == "inference service: no session 'x'"
    fake.fail = (500, "Internal Server Error")
    with pytest.raises(UpstreamError) as info:
        await link.export("sess-abc", "individual", 1.0, False)
    assert (info.value.http_status, info.value.code) == (502, "inference_error")
    assert "Internal Server Error" in info.value.message


async def test_an_agent_session_refused_by_admission_keeps_the_429_and_retry_after(
    served,
) -> None:
    fake, link = served
    fake.fail = (
        429,
        {
            "error": {
                "message": "Model 'tiny' is at its staleness bound",
                "type": "rate_limit_error",
                "code": "staleness_bound",
            }
        },
    )
    fake.fail_headers = {"Retry-After": "4"}
    with pytest.raises(AdmissionRefused) as info:
        await link.start_session("agent-1")
    e = info.value
    assert (e.http_status, e.code, e.retry_after_s) == (429, "staleness_bound", 4)


async def test_an_answer_of_the_wrong_shape_is_502(served) -> None:
    fake, link = served
    fake.fail = (201, {"group_id": "g"})  # no sessions
    with pytest.raises(ServiceError) as info:
        await link.start_session("agent-1")
    assert info.value.http_status == 502 and "sessions" in info.value.message


async def test_a_bad_reward_is_refused_without_a_call(served) -> None:
    fake, link = served
    with pytest.raises(InvalidRequest) as info:
        await link.set_reward(KEY, math.nan)
    assert info.value.http_status == 400 and fake.seen == []


async def test_an_unreachable_inference_service_is_503() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = InferenceLink(f"http://127.0.0.1:{port}", ADMIN)
    try:
        with pytest.raises(Unavailable) as info:
            await link.start_session("agent-1")
    finally:
        await link.close()
    assert (info.value.http_status, info.value.code) == (503, "inference_unavailable")
    assert f"127.0.0.1:{port} unreachable" in info.value.message


async def test_an_export_without_removal_has_no_export_id_and_a_failed_ack_is_an_error(
    served,
) -> None:
    fake, link = served
    assert await link.export("sess-abc", "individual", 1.0, False) == ([ROW], "")
    assert [p for p, _, _ in fake.seen] == ["/rl/export_trajectories"]
    fake.fail = (503, {"error": {"message": "proxy down", "type": "api_error", "code": "down"}})
    with pytest.raises(UpstreamError) as info:
        await link.ack_export(KEY, "exp-1.x")
    assert (info.value.http_status, info.value.code) == (502, "down")


async def test_the_agent_proxy_passes_the_export_id_on_and_acks_only_when_asked(served) -> None:
    """Through the agent proxy's RPCs: ExportAgentTrajectories with removal answers the
    inference export's id and acknowledges nothing; AckAgentExport does, for its session."""
    fake, link = served
    with socket.socket() as sock:  # no worker: the RPCs used here do not need one
        sock.bind(("127.0.0.1", 0))
        worker_port = sock.getsockname()[1]
    settings = Settings(
        worker_addr=f"127.0.0.1:{worker_port}",
        metrics_port=-1,
        drain_timeout=0.5,
        inf_gateway_url=link.gateway_url,
        inf_admin_api_key=ADMIN,
        inf_model="tiny",
    )
    server = AgentProxyServer(settings)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        agent = proxy_pb2_grpc.AgentProxyServiceStub(channel)
        await agent.CreateAgentSession(
            proxy_pb2.CreateAgentSessionRequest(
                session_id="a1", session_api_key="agent-key", metadata=b"{}"
            )
        )
        own = envelope_pb2.Envelope(api_key="agent-key", session_id="a1")
        export = proxy_pb2.ExportTrajectoriesRequest(
            session_ids=["a1"], discount=1.0, remove_session=True, envelope=own
        )
        for _ in range(2):  # unacknowledged: the same rows again, nothing removed
            chunks = [c async for c in agent.ExportAgentTrajectories(export)]
            assert [(c.rows, c.export_id) for c in chunks] == [(1, "exp-1.x")]
            row = json.loads(chunks[0].jsonl)
            assert row["agent_session_id"] == "a1" and row["session_id"] == "sess-abc"
        assert "/rl/ack_export" not in [p for p, _, _ in fake.seen]
        # Another key may not acknowledge this session's export; no export_id is a 400.
        other = envelope_pb2.Envelope(api_key="other-key", session_id="a1")
        for req, code in (
            (
                proxy_pb2.AckAgentExportRequest(
                    session_id="a1", export_id="exp-1.x", envelope=other
                ),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
            (
                proxy_pb2.AckAgentExportRequest(session_id="a1", envelope=own),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (
                proxy_pb2.AckAgentExportRequest(session_id="zz", export_id="e", envelope=own),
                grpc.StatusCode.NOT_FOUND,
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await agent.AckAgentExport(req)
            assert ei.value.code() == code, ei.value.details()
        assert "/rl/ack_export" not in [p for p, _, _ in fake.seen]
        ack = await agent.AckAgentExport(
            proxy_pb2.AckAgentExportRequest(session_id="a1", export_id="exp-1.x", envelope=own)
        )
        assert list(ack.removed_session_ids) == ["a1"] and not ack.kept_session_ids
        assert fake.seen[-1] == ("/rl/ack_export", KEY, {"export_id": "exp-1.x"})
    finally:
        await channel.close()
        await server.shutdown()
