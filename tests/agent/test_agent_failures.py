"""Failures through real processes: an agent that raises, a worker killed with SIGKILL.

FlakyAgent (areal_test_agents) answers `<worker pid>:<message>`, so each answer says which
pair's worker ran it, and raises on "boom".
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from agent_stack import AgentStack, start_agent_stack, wait_health, wait_healthy, workers

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def stack(tmp_path):
    st = start_agent_stack(tmp_path, "areal_test_agents.FlakyAgent", n_pairs=2)
    yield st
    st.stop()


def _new(c: httpx.Client) -> dict:
    r = c.post("/v1/sessions")
    assert r.status_code == 201, r.text
    return r.json()


def _say(stack: AgentStack, s: dict, text: str, **extra) -> httpx.Response:
    with stack.client(s["session_api_key"]) as c:
        return c.post("/v1/responses", json={"input": text, **extra})


def _answer(r: httpx.Response) -> str:
    return r.json()["output"][0]["content"][0]["text"]


def test_agent_error_is_openai_shaped_and_the_session_survives(stack: AgentStack) -> None:
    with stack.client() as c:
        s = _new(c)
    assert _say(stack, s, "hello").status_code == 200
    r = _say(stack, s, "boom now")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "agent_error" and err["code"] == "agent_error"
    assert "RuntimeError" in err["message"] and "boom now" in err["message"]
    # chat, non-streamed: the same error
    with stack.client(s["session_api_key"]) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "agent_error"
        # streamed: a final error event (Responses: error + response.failed; chat: error, [DONE])
        with c.stream("POST", "/v1/responses", json={"input": "boom", "stream": True}) as st:
            assert st.status_code == 200
            events = [orjson.loads(x[6:]) for x in st.iter_lines() if x.startswith("data: ")]
        assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
        assert events[-2]["code"] == "agent_error"
        assert events[-1]["response"]["status"] == "failed"
        body = {"messages": [{"role": "user", "content": "boom"}], "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as st:
            lines = [x for x in st.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert orjson.loads(lines[-2][6:])["error"]["type"] == "agent_error"
        # the session survives; failed turns are not in its history
        r = _say(stack, s, "after")
        assert r.status_code == 200 and _answer(r).endswith(":after")
        hist = c.get(f"/v1/sessions/{s['session_id']}/history").json()["history"]
    assert [h["content"] for h in hist if h["role"] == "user"] == ["hello", "after"]


def test_sigkill_worker_fails_its_sessions_fast_others_unaffected(stack: AgentStack) -> None:
    with stack.client() as c:
        sessions = [_new(c) for _ in range(6)]
    pid_to_pair = {p.worker.popen.pid: p.index for p in stack.pairs}
    where = {}
    for s in sessions:
        r = _say(stack, s, "where")
        assert r.status_code == 200
        where[s["session_id"]] = pid_to_pair[int(_answer(r).split(":")[0])]
    assert set(where.values()) == {0, 1}, where  # placed on both pairs

    stack.kill_worker(0)
    dead = [s for s in sessions if where[s["session_id"]] == 0]
    alive = [s for s in sessions if where[s["session_id"]] == 1]
    for s in dead:
        t0 = time.monotonic()
        r = _say(stack, s, "are you there")
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert took < 2.0, took
        msg = r.json()["error"]["message"]
        assert "worker" in msg or "proxy-0" in msg, msg
        # streamed requests fail the same way, before any event
        with stack.client(s["session_api_key"]) as c:
            r = c.post("/v1/responses", json={"input": "x", "stream": True})
            assert r.status_code == 503
    for s in alive:
        r = _say(stack, s, "still here")
        assert r.status_code == 200 and _answer(r).endswith(":still here")
    # the pair shows unhealthy; new sessions go to the healthy pair only
    took = wait_health(stack, "proxy-0", "unhealthy")
    print(f"\nproxy-0 unhealthy in /admin/workers {took:.2f} s after the check started")
    ws = workers(stack)
    assert ws["proxy-1"]["health"] == "healthy"
    assert "worker" in ws["proxy-0"]["last_error"] or ws["proxy-0"]["last_error"]
    with stack.client() as c:
        for _ in range(3):
            s = _new(c)
            r = _say(stack, s, "new")
            assert r.status_code == 200
            assert pid_to_pair[int(_answer(r).split(":")[0])] == 1
        # a dead pair's session: 503 from the router now, fast
        t0 = time.monotonic()
        r = _say(stack, dead[0], "x")
        assert r.status_code == 503 and time.monotonic() - t0 < 1.0
        # removing the dead pair: its sessions are gone with it
        assert c.delete("/admin/pairs/proxy-0").status_code == 200
        assert set(workers(stack)) == {"proxy-1"}
        wait_healthy(stack, 1)
