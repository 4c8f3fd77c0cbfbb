"""Agent sessions through real processes: placement, stickiness, ordered turns, history, keys.

Three (worker, proxy) pairs run examples.agents.counter.CounterAgent, which keeps its own
per-session turn count in the worker process and asserts that the history areal sends has
2 * (turn - 1) entries: a turn on the wrong pair, out of order or overlapping fails there.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agent_stack import ADMIN_KEY, AgentStack, start_agent_stack, workers

N_PAIRS = 3
N_SESSIONS = 30
N_TURNS = 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    st = start_agent_stack(
        tmp_path_factory.mktemp("agent-counter"),
        "examples.agents.counter.CounterAgent",
        n_pairs=N_PAIRS,
    )
    yield st
    st.stop()


def _text(resp: dict) -> str:
    return "".join(
        part["text"]
        for item in resp["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def _one_session(c: httpx.AsyncClient, stack: AgentStack, i: int) -> dict:
    r = await c.post("/v1/sessions", json={"metadata": {"n": i}})
    assert r.status_code == 201, r.text
    s = r.json()
    assert set(s) == {"session_id", "session_api_key"}
    headers = {"Authorization": f"Bearer {s['session_api_key']}"}
    texts = []
    for t in range(1, N_TURNS + 1):
        r = await c.post("/v1/responses", json={"input": f"s{i} m{t}"}, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "response" and body["status"] == "completed"
        assert body["metadata"]["session_id"] == s["session_id"]
        assert r.headers["x-areal-session-id"] == s["session_id"]
        texts.append(_text(body))
    assert texts == [f"turn {t}: s{i} m{t}" for t in range(1, N_TURNS + 1)]
    r = await c.get(f"/v1/sessions/{s['session_id']}/history", headers=headers)
    assert r.status_code == 200, r.text
    want = []
    for t in range(1, N_TURNS + 1):
        want += [
            {"role": "user", "content": f"s{i} m{t}"},
            {"role": "assistant", "content": f"turn {t}: s{i} m{t}"},
        ]
    assert r.json() == {"session_id": s["session_id"], "history": want}
    return s


async def test_concurrent_sessions_stay_on_their_pair_in_order(stack: AgentStack) -> None:
    async with stack.async_client() as c:
        sessions = await asyncio.gather(*(_one_session(c, stack, i) for i in range(N_SESSIONS)))
    assert len({s["session_id"] for s in sessions}) == N_SESSIONS
    # Every pair got sessions (placed by load), as the router and the proxies report.
    ws = workers(stack)
    assert set(ws) == {p.proxy_id for p in stack.pairs}
    assert all(w["health"] == "healthy" and w["kind"] == "agent" for w in ws.values())
    per_pair = {pid: w["sessions"] for pid, w in ws.items()}
    assert all(n >= N_SESSIONS // N_PAIRS - 2 for n in per_pair.values()), per_pair
    assert sum(per_pair.values()) >= N_SESSIONS, per_pair


async def test_turns_of_one_session_are_serialized(stack: AgentStack) -> None:
    """Five turns sent at once: each runs after the previous one (the agent would assert)."""
    async with stack.async_client() as c:
        s = (await c.post("/v1/sessions")).json()
        headers = {"Authorization": f"Bearer {s['session_api_key']}"}
        rs = await asyncio.gather(
            *(
                c.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"c{k}"}]},
                    headers=headers,
                )
                for k in range(5)
            )
        )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        answers = [r.json()["choices"][0]["message"]["content"] for r in rs]
        assert sorted(a.split(":")[0] for a in answers) == [f"turn {t}" for t in range(1, 6)]
        hist = (await c.get(f"/v1/sessions/{s['session_id']}/history", headers=headers)).json()
        assert len(hist["history"]) == 10
        # history pairs each user message with its own answer
        for u, a in zip(hist["history"][::2], hist["history"][1::2], strict=True):
            assert a["content"].endswith(u["content"])


def test_keys_are_scoped(stack: AgentStack) -> None:
    with stack.client() as admin:
        a = admin.post("/v1/sessions").json()
        b = admin.post("/v1/sessions").json()
        # unauthenticated / unknown keys: 401 on every agent endpoint
        for method, path in [
            ("POST", "/v1/sessions"),
            ("POST", "/v1/responses"),
            ("POST", "/v1/chat/completions"),
            ("GET", f"/v1/sessions/{a['session_id']}/history"),
            ("DELETE", f"/v1/sessions/{a['session_id']}"),
            ("POST", f"/v1/sessions/{a['session_id']}/reward"),
            ("POST", f"/v1/sessions/{a['session_id']}/export"),
            ("GET", "/admin/workers"),
            ("POST", "/admin/pairs"),
        ]:
            r = httpx.request(method, stack.gateway_url + path, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key", path
            r = httpx.request(
                method, stack.gateway_url + path, json={}, headers={"Authorization": "Bearer nope"}
            )
            assert r.status_code == 401, path
        assert httpx.get(stack.gateway_url + "/health").status_code == 200
        assert httpx.get(stack.gateway_url + "/metrics").status_code == 200
    with stack.client(a["session_api_key"]) as ka:
        # b's session with a's key: refused
        assert ka.get(f"/v1/sessions/{b['session_id']}/history").status_code == 403
        assert ka.delete(f"/v1/sessions/{b['session_id']}").status_code == 403
        r = ka.post(
            "/v1/responses", json={"input": "x", "metadata": {"session_id": b["session_id"]}}
        )
        assert r.status_code == 403, r.text
        # admin-only endpoints
        assert ka.post("/v1/sessions").status_code == 403
        assert ka.get("/admin/workers").status_code == 403
        assert (
            ka.post("/admin/pairs", json={"proxy_id": "x", "address": "127.0.0.1:1"}).status_code
            == 403
        )
        # own session works
        r = ka.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and _text(r.json()) == "turn 1: hi"
    # A key that claims b's session with a made-up MAC (or none, the old shape): the gateway
    # refuses it (401) before asking the router where b lives.
    for forged in (
        b["session_api_key"].rsplit(".", 1)[0] + "." + "A" * 22,
        b["session_api_key"].rsplit(".", 1)[0],
    ):
        with stack.client(forged) as kf:
            for r in (
                kf.post("/v1/responses", json={"input": "x"}),
                kf.get(f"/v1/sessions/{b['session_id']}/history"),
                kf.delete(f"/v1/sessions/{b['session_id']}"),
            ):
                assert r.status_code == 401, r.text
                assert r.json()["error"]["type"] == "authentication_error"
    with stack.client(b["session_api_key"]) as kb:
        r = kb.post("/v1/responses", json={"input": "still mine"})
        assert r.status_code == 200 and _text(r.json()) == "turn 1: still mine"
        # previous_response_id continues the session it names
        r2 = kb.post(
            "/v1/responses", json={"input": "again", "previous_response_id": r.json()["id"]}
        )
        assert r2.status_code == 200 and _text(r2.json()) == "turn 2: again"
        assert kb.delete(f"/v1/sessions/{b['session_id']}").json() == {
            "session_id": b["session_id"],
            "closed": True,
        }
        r = kb.post("/v1/responses", json={"input": "gone"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert kb.delete(f"/v1/sessions/{b['session_id']}").status_code == 404


def test_admin_turns_and_pairs(stack: AgentStack) -> None:
    with stack.client(ADMIN_KEY) as c:
        # the admin key without a session: a new session, named in metadata and a header
        r = c.post("/v1/responses", json={"input": "first"})
        assert r.status_code == 200, r.text
        sid = r.json()["metadata"]["session_id"]
        assert r.headers["x-areal-session-id"] == sid
        r = c.post("/v1/responses", json={"input": "second", "metadata": {"session_id": sid}})
        assert _text(r.json()) == "turn 2: second"
        assert len(c.get(f"/v1/sessions/{sid}/history").json()["history"]) == 4
        # an admin chat without a session runs in a one-request session
        r = c.post(
            "/v1/chat/completions",
            json={"model": "agent", "messages": [{"role": "user", "content": "q"}]},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "turn 1: q"
        assert r.json()["object"] == "chat.completion"
        # bad input: 400 in OpenAI shape
        r = c.post("/v1/responses", json={"input": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_user_message"
        # not linked to an inference service: reward and export say so
        r = c.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_linked"
        # pairs: list, bad address, unknown removal
        pairs = c.get("/admin/pairs").json()["pairs"]
        assert sorted(p["proxy_id"] for p in pairs) == ["proxy-0", "proxy-1", "proxy-2"]
        assert (
            c.post("/admin/pairs", json={"proxy_id": "x", "address": "nowhere"}).status_code == 400
        )
        assert c.delete("/admin/pairs/unknown").status_code == 404
