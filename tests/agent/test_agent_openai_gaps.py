"""Agent gateway: `GET /v1/models`, implicit admin sessions and `store`, the export's shape.

Real processes (router, gateway `--mode agent`, one pair running EchoAgent); the pair is
linked to a stand-in inference gateway in this process (its RL API only: start, end, export,
ack), so that the agent export has rows without an engine.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from agent_stack import ADMIN_KEY, AgentStack, start_agent_stack

INF_ADMIN_KEY = "stand-in-inference-admin"


class StandInInference:
    """`/rl/*` of an inference gateway: one RL session per agent session, two rows each."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.exports: list[dict[str, Any]] = []
        ids = itertools.count(1)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                out: dict[str, Any]
                if self.path == "/rl/start_session":
                    sid = f"rl{next(ids)}"
                    out = {
                        "group_id": f"g-{sid}",
                        "task_id": body.get("task_id", ""),
                        "model": "m",
                        "sessions": [{"session_id": sid, "session_api_key": f"areal-sk-{sid}.s"}],
                    }
                elif self.path == "/rl/end_session":
                    key = self.headers["Authorization"].removeprefix("Bearer ")
                    owner.ended.append(key.removeprefix("areal-sk-").split(".")[0])
                    out = {"ended": 1}
                elif self.path == "/rl/export_trajectories":
                    owner.exports.append(body)
                    sid = body["session_ids"][0]
                    rows = [_row(sid, i) for i in range(2)]
                    out = {"count": len(rows), "rows": rows}
                    if body.get("remove_session"):
                        out["export_id"] = f"x.{sid}"
                elif self.path == "/rl/ack_export":
                    out = {"export_id": body["export_id"], "removed": [], "kept": []}
                else:
                    self.send_error(404)
                    return
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _row(session_id: str, i: int) -> dict[str, Any]:
    return {
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.5, -0.25],
        "versions": [-1, 0, 0],
        "reward": float(i),
        "session_id": session_id,
        "group_id": f"g-{session_id}",
        "task_id": "t",
        "interaction_id": f"i{i}",
        "interaction_ids": [f"i{i}"],
        "finish_reason": "stop",
    }


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentStack, Any]]:
    inf = StandInInference()
    try:
        st = start_agent_stack(
            tmp_path_factory.mktemp("agent-gaps"),
            "examples.agents.echo.EchoAgent",
            n_pairs=1,
            proxy_args=["--inf-gateway-url", inf.url, "--inf-model", "m"],
            proxy_env={"AREAL_PROXY_INF_ADMIN_API_KEY": INF_ADMIN_KEY},
        )
    except BaseException:
        inf.stop()
        raise
    yield st, inf
    st.stop()
    inf.stop()


def _session(st: AgentStack) -> dict[str, Any]:
    with st.client() as admin:
        r = admin.post("/v1/sessions")
        assert r.status_code == 201, r.text
        return r.json()


def test_models_lists_the_agent(linked: tuple[AgentStack, Any]) -> None:
    st, _ = linked
    s = _session(st)
    for key in (ADMIN_KEY, s["session_api_key"]):
        with st.client(key) as c:
            r = c.get("/v1/models")
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and len(body["data"]) == 1
            model = body["data"][0]
            assert model["id"] == "agent" and model["object"] == "model"
            assert model["owned_by"] == "areal" and model["created"] > 0
            r = c.get("/v1/models/agent")
            assert r.status_code == 200 and r.json() == model
            r = c.get("/v1/models/other")
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for headers in ({}, {"Authorization": "Bearer not-a-key"}):
        r = httpx.get(st.gateway_url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, r.text
    # The SDK lists it, and the id it lists is a model the agent gateway takes.
    client = openai.OpenAI(
        base_url=st.gateway_url + "/v1", api_key=s["session_api_key"], max_retries=0
    )
    [listed] = client.models.list().data
    resp = client.responses.create(model=listed.id, input="hi")
    assert resp.output_text == "hi" and resp.model == "agent"


def _gone(st: AgentStack, sid: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    with st.client() as admin:
        while time.monotonic() < deadline:
            r = admin.get(f"/v1/sessions/{sid}/history")
            if r.status_code == 404:
                return True
            assert r.status_code == 200, r.text
            time.sleep(0.1)
    return False


def test_admin_turn_without_session_store_false_ends_its_session(
    linked: tuple[AgentStack, Any],
) -> None:
    st, inf = linked
    with st.client() as admin:
        r = admin.post("/v1/responses", json={"input": "once", "store": False})
        assert r.status_code == 200, r.text
        sid = r.headers["x-areal-session-id"]
        assert r.json()["metadata"]["session_id"] == sid
        assert _gone(st, sid), "the implicit session of a store:false turn is still open"
        # Its linked RL session was ended too (just after the session was dropped).
        deadline = time.monotonic() + 10
        while not inf.ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inf.ended
        r = admin.post("/v1/responses", json={"input": "x", "store": "no"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_admin_turn_without_session_stored_can_chain(linked: tuple[AgentStack, Any]) -> None:
    st, _ = linked
    with st.client() as admin:
        r = admin.post("/v1/responses", json={"input": "first"})
        assert r.status_code == 200, r.text
        sid = r.headers["x-areal-session-id"]
        r2 = admin.post(
            "/v1/responses", json={"input": "second", "previous_response_id": r.json()["id"]}
        )
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-areal-session-id"] == sid
        r = admin.get(f"/v1/sessions/{sid}/history")
        assert r.status_code == 200 and len(r.json()["history"]) == 4
        assert admin.delete(f"/v1/sessions/{sid}").status_code == 200
        # The idle timeout of such a session is reserved to the gateway.
        r = admin.post("/v1/sessions", json={"metadata": {"areal_idle_timeout_s": 5}})
        assert r.status_code == 400, r.text


def test_agent_export_has_the_rl_export_shape(linked: tuple[AgentStack, Any]) -> None:
    st, inf = linked
    s = _session(st)
    sid = s["session_id"]
    with st.client(s["session_api_key"]) as c:
        r = c.post(f"/v1/sessions/{sid}/export", json={})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"count", "rows"}
        assert body["count"] == len(body["rows"]) == 2
        assert all(row["agent_session_id"] == sid for row in body["rows"])
        # discount 0 is 0 (not the default), as for /rl/export_trajectories.
        r = c.post(f"/v1/sessions/{sid}/export", json={"discount": 0.0, "style": None})
        assert r.status_code == 200, r.text
        assert inf.exports[-1]["discount"] == 0.0 and inf.exports[-1]["style"] == "individual"
        r = c.post(f"/v1/sessions/{sid}/export", json={"discount": 1.5})
        assert r.status_code == 400, r.text
        # With removal the link acknowledges the export itself: no export_id to pass on.
        r = c.post(f"/v1/sessions/{sid}/export", json={"remove_session": True})
        assert r.status_code == 200 and set(r.json()) == {"count", "rows"}
