"""GET /rl/sessions/{session_id}: a session's status from the proxy that holds it.

The FAKE router pins the session to one FAKE proxy, which answers `GetSession` with a
canned status: the route finds that proxy by the session's pin, passes who asks in the
envelope, answers in its declared shape, and refuses another session's key before anything
is routed.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import Stack
from test_errors import assert_error

from areal_gateway.schemas import SessionStatus

MODEL = "m-status"


def _status(sid: str, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "session_id": sid,
        "group_id": "group-1",
        "task_id": "t-1",
        "model": MODEL,
        "created_at": 1700000000.5,
        "last_active_at": 1700000009.25,
        "ended": False,
        "interactions": 3,
        "prompt": {
            "incremental": 2,
            "full": 1,
            "fallbacks": {},
            "cached": True,
            "last_prompt_tokens": 57,
        },
    }
    doc.update(over)
    return doc


@pytest.fixture
def held(stack: Stack) -> Any:
    """Sessions pinned to p1 (not the first proxy, so the pin, not chance, finds it)."""
    stack.register(MODEL)
    proxy = stack.proxies["p1"]
    sids = ["sess-status-a", "sess-status-b", "sess-status-bad"]
    for sid in sids[:2]:
        stack.router.pins[sid] = f"{MODEL}-p1"
        proxy.statuses[sid] = _status(sid)
    stack.router.pins[sids[2]] = f"{MODEL}-p1"
    proxy.statuses[sids[2]] = ["not", "an", "object"]  # type: ignore[assignment]
    yield proxy
    for sid in sids:
        stack.router.pins.pop(sid, None)
        proxy.statuses.pop(sid, None)


def _get(stack: Stack, sid: str, key: str) -> httpx.Response:
    return httpx.get(
        f"{stack.url}/rl/sessions/{sid}", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )


def test_admin_reads_any_session_from_the_proxy_that_holds_it(
    stack: Stack, held: Any, admin_headers: dict[str, str]
) -> None:
    before = len(stack.proxies["p0"].received)
    r = httpx.get(f"{stack.url}/rl/sessions/sess-status-a", headers=admin_headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == _status("sess-status-a")
    SessionStatus.model_validate(r.json())
    route = stack.router.routes[-1]
    assert (route.session_id, route.model) == ("sess-status-a", "")
    got = held.received[-1]
    assert got.method == "GetSession" and got.body == b"sess-status-a"
    assert got.envelope.is_admin and not got.envelope.session_id
    assert got.envelope.request_id  # traced like every proxy call
    assert len(stack.proxies["p0"].received) == before


def test_a_session_key_reads_its_own_session_only(stack: Stack, held: Any) -> None:
    key = stack.gw.gateway.auth.mint_session_key("sess-status-b")
    r = _get(stack, "sess-status-b", key)
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == "sess-status-b"
    env = held.received[-1].envelope
    assert (env.session_id, env.api_key, env.is_admin) == ("sess-status-b", key, False)
    # Another session's: refused by the gateway, before the router or a proxy sees it.
    routes, received = len(stack.router.routes), len(held.received)
    assert_error(_get(stack, "sess-status-a", key), 403, "forbidden_session")
    assert (len(stack.router.routes), len(held.received)) == (routes, received)


def test_unknown_sessions_and_bad_answers(
    stack: Stack, held: Any, admin_headers: dict[str, str]
) -> None:
    # Not pinned: the router does not know it.
    r = httpx.get(f"{stack.url}/rl/sessions/sess-status-none", headers=admin_headers, timeout=10)
    assert_error(r, 404, "session_not_found")
    # Pinned, but the proxy does not have it.
    stack.router.pins["sess-status-gone"] = f"{MODEL}-p1"
    try:
        r = httpx.get(
            f"{stack.url}/rl/sessions/sess-status-gone", headers=admin_headers, timeout=10
        )
        assert_error(r, 404, "session_not_found")
    finally:
        stack.router.pins.pop("sess-status-gone")
    # A status that is no JSON object: the proxy's fault, a 502.
    r = httpx.get(f"{stack.url}/rl/sessions/sess-status-bad", headers=admin_headers, timeout=10)
    assert_error(r, 502, "upstream_error")
    # No key: 401 before anything else.
    assert_error(httpx.get(f"{stack.url}/rl/sessions/sess-status-a", timeout=10), 401)
