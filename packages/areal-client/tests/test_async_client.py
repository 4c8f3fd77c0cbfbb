"""AsyncArealClient: the same requests and results as ArealClient, awaited."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_fakes import (
    ADMIN,
    BASE,
    EXPORT_ID,
    FakeGateway,
    ack_answer,
    bearer,
    control_answer,
    export_answer,
    group_answer,
    row,
    status_answer,
)

from areal_client import (
    APIConnectionError,
    APITimeoutError,
    ArealClient,
    AsyncArealClient,
    ExportInterruptedError,
    NotFoundError,
    PartialFailureError,
    Session,
)

S = Session("sess-0", "areal-sk-sess-0.s0", "group-1", BASE)

# (method name, args, kwargs) for every call both clients have.
CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("health", (), {}),
    ("served_models", (), {}),
    ("list_models", (), {}),
    ("list_workers", (), {}),
    ("start_group", ("t-1", 2, "tiny"), {}),
    ("start_session", ("t-1",), {}),
    ("start_group", ("t-1", 2, "tiny"), {"wait_s": 2.5}),
    ("set_reward", (S, 0.5), {"interaction_id": "c-1"}),
    ("set_reward", ("sess-0", 1.0), {}),
    ("end_session", (S,), {}),
    ("end_session", ("sess-0",), {}),
    ("session_status", (S,), {}),
    ("session_status", ("sess-0",), {}),
    ("export", (), {"group_id": "group-1", "style": "concat", "discount": 0.5}),
    ("export", (), {"session": S, "remove_session": True}),
    ("ack_export", ("exp-2.x",), {}),
    ("pause", (), {"model": "tiny"}),
    ("resume", (), {"worker": "p0"}),
    ("set_version", (3,), {}),
    ("update_weights", ("/ckpt",), {"version": 9}),
]


def _gateway() -> FakeGateway:
    gw = FakeGateway()
    gw.on("GET", "/health", {"status": "ok"})
    gw.on("GET", "/v1/models", {"data": [{"id": "tiny"}]})
    gw.on("GET", "/admin/models", {"models": []})
    gw.on("GET", "/admin/workers", {"workers": []})

    def start(request: httpx.Request) -> httpx.Response:
        n = json.loads(request.content)["group_size"]
        return httpx.Response(201, json=group_answer(n))

    gw.on("POST", "/rl/start_session", start)
    gw.on("POST", "/rl/set_reward", {"session_id": "sess-0", "interaction_id": "c-1", "reward": 1})
    gw.on("POST", "/rl/end_session", {"ended": 1})
    gw.on("GET", "/rl/sessions/sess-0", status_answer())
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0)))
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0"]))
    for action in ("pause", "continue", "set_version", "update_weights"):
        gw.on("POST", f"/admin/{action}", control_answer(action))
    return gw


def _shape(r: httpx.Request) -> tuple[Any, ...]:
    headers = {
        k: v
        for k, v in r.headers.items()
        if k.lower() in ("authorization", "accept", "content-type")
    }
    return (r.method, str(r.url), headers, json.loads(r.content) if r.content else None)


async def test_both_clients_send_the_same_requests_and_read_the_same_results() -> None:
    sync_gw, async_gw = _gateway(), _gateway()
    with ArealClient(BASE, ADMIN, transport=sync_gw.transport()) as c:
        sync_results = [getattr(c, name)(*a, **kw) for name, a, kw in CALLS]
    async with AsyncArealClient(BASE, ADMIN, transport=async_gw.transport()) as ac:
        async_results = [await getattr(ac, name)(*a, **kw) for name, a, kw in CALLS]
    assert [_shape(r) for r in async_gw.requests] == [_shape(r) for r in sync_gw.requests]
    assert async_results == sync_results
    # Each call is one request, and the export with removal acknowledges it: one more.
    assert len(sync_gw.requests) == len(CALLS) + 1


async def test_async_iter_export_streams_rows_then_raises_on_an_error_line() -> None:
    gw = FakeGateway()
    err = {"error": {"message": "export failed", "type": "api_error", "code": "store"}}
    gw.on(
        "POST",
        "/rl/export_trajectories",
        httpx.Response(
            200,
            content=(
                json.dumps(row(0)) + "\n" + json.dumps(row(1)) + "\n" + json.dumps(err) + "\n"
            ).encode(),
            headers={"Content-Type": "application/x-ndjson"},
        ),
    )
    async with AsyncArealClient(BASE, ADMIN, transport=gw.transport()) as ac:
        got = []
        with pytest.raises(ExportInterruptedError) as info:
            async for r in ac.iter_export(session_ids=["sess-0", "sess-1"]):
                got.append(r.to_dict())
    assert got == [row(0), row(1)]
    assert info.value.rows_read == 2 and info.value.code == "store"
    assert gw.last.headers["Accept"] == "application/x-ndjson" and bearer(gw.last) == ADMIN


async def test_async_export_with_removal_unacknowledged() -> None:
    gw = FakeGateway()
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0)))
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0"]))
    own = Session("sess-0", "areal-sk-sess-0.s0", "t", BASE)
    async with AsyncArealClient(BASE, ADMIN, transport=gw.transport()) as ac:
        result = await ac.export(session=own, remove_session=True, acknowledge=False)
        assert [q.url.path for q in gw.requests] == ["/rl/export_trajectories"]
        assert result.export_id == EXPORT_ID and [r.session_id for r in result] == ["sess-0"]
        ack = await ac.export(session=own, remove_session=True)  # the default acknowledges
        assert ack.export_id == EXPORT_ID
        assert [q.url.path for q in gw.requests][-1] == "/rl/ack_export"
        n = len(gw.requests)
        out = await ac.ack_export(result.export_id, session=own)
        assert out.removed == ["sess-0"] and len(gw.requests) == n + 1
        assert bearer(gw.last) == "areal-sk-sess-0.s0"


async def test_async_errors_are_the_same_types() -> None:
    gw = FakeGateway()
    gw.on(
        "POST",
        "/rl/export_trajectories",
        {"error": {"message": "gone", "type": "not_found_error", "code": "session_not_found"}},
        404,
    )
    gw.on(
        "POST",
        "/admin/update_weights",
        control_answer(
            "update_weights",
            {"proxy_id": "p0", "model": "m", "paused": False, "version": 2, "message": ""},
            {"proxy_id": "p1", "model": "m", "error": "boom"},
        ),
        207,
    )
    async with AsyncArealClient(BASE, ADMIN, transport=gw.transport()) as ac:
        with pytest.raises(NotFoundError) as nf:
            await ac.export(session_ids=["s"])
        assert nf.value.code == "session_not_found"
        with pytest.raises(NotFoundError):
            async for _ in ac.iter_export(session_ids=["s"]):
                pass
        with pytest.raises(PartialFailureError) as pf:
            await ac.update_weights("/ckpt")
        assert pf.value.result.version == 2
        with pytest.raises(ValueError, match="exactly one"):
            ac.iter_export()  # refused before any request


async def test_async_connection_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.PoolTimeout("pool", request=request)

    async with AsyncArealClient(BASE, ADMIN, transport=httpx.MockTransport(refuse)) as ac:
        with pytest.raises(APIConnectionError) as info:
            await ac.start_session()
        assert not isinstance(info.value, APITimeoutError)
    async with AsyncArealClient(BASE, ADMIN, transport=httpx.MockTransport(slow)) as ac:
        with pytest.raises(APITimeoutError):
            async for _ in ac.iter_export(group_id="g"):
                pass


async def test_async_start_when_admitted_honours_retry_after(monkeypatch) -> None:
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr("areal_client.async_client.async_sleep", fake_sleep)
    refusal = httpx.Response(
        429,
        json={"error": {"message": "full", "type": "rate_limit_error", "code": "staleness_bound"}},
        headers={"Retry-After": "4"},
    )
    answers = [refusal, httpx.Response(201, json=group_answer(1))]
    gw = FakeGateway()
    gw.on("POST", "/rl/start_session", lambda request: answers.pop(0))
    async with AsyncArealClient(BASE, ADMIN, transport=gw.transport()) as client:
        session = await client.start_session_when_admitted(max_wait_s=60)
    assert session.session_id == "sess-0" and slept == [4.0]
