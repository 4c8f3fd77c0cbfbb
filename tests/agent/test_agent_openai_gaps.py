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
    """`/rl/*` of an inference gateway: one RL session per agent session, two rows each.

    Removal is two-phase as there: an export with `remove_session` claims the session under a
    new export_id and removes nothing; `/rl/ack_export` with it (a session key: only its own
    session's) removes the rows, once."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.exports: list[dict[str, Any]] = []
        self.acks: list[tuple[str, str]] = []  # (export_id, bearer)
        self.removed: set[str] = set()
        claims: dict[str, str] = {}  # export_id -> the RL session it claimed
        ids = itertools.count(1)
        export_ids = itertools.count(1)
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
                    rows = [] if sid in owner.removed else [_row(sid, i) for i in range(2)]
                    out = {"count": len(rows), "rows": rows}
                    if body.get("remove_session"):
                        out["export_id"] = f"exp-{next(export_ids)}.{sid}"
                        claims[out["export_id"]] = sid
                elif self.path == "/rl/ack_export":
                    key = self.headers["Authorization"].removeprefix("Bearer ")
                    owner.acks.append((body["export_id"], key))
                    # As there, the id names the session it routes to; the claim goes once.
                    sid = body["export_id"].partition(".")[2]
                    if key != INF_ADMIN_KEY and key != f"areal-sk-{sid}.s":
                        self._answer(403, _forbidden())
                        return
                    removed = [sid] if claims.pop(body["export_id"], None) else []
                    owner.removed.update(removed)
                    out = {"export_id": body["export_id"], "removed": removed, "kept": []}
                else:
                    self.send_error(404)
                    return
                self._answer(200, out)

            def _answer(self, status: int, out: dict[str, Any]) -> None:
                data = json.dumps(out).encode()
                self.send_response(status)
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


def _forbidden() -> dict[str, Any]:
    msg = "A session key may acknowledge only its own session's export."
    return {"error": {"message": msg, "type": "permission_error", "code": "forbidden_session"}}


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
        "response_id": f"i{i}",
        "choice_index": 0,
        "replicas": [[1, "p0"]],
        "chain_id": f"i{i}",
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
        assert inf.exports[-1]["discount"] == 0.0 and inf.exports[-1]["style"] == "concat"
        r = c.post(f"/v1/sessions/{sid}/export", json={"discount": 1.5})
        assert r.status_code == 400, r.text
        # With removal, as /rl/export_trajectories: the id that removes them once acknowledged.
        r = c.post(f"/v1/sessions/{sid}/export", json={"remove_session": True})
        assert r.status_code == 200 and set(r.json()) == {"count", "rows", "export_id"}


def test_agent_export_with_removal_removes_only_once_acknowledged(
    linked: tuple[AgentStack, Any],
) -> None:
    st, inf = linked
    s, other = _session(st), _session(st)
    sid, rl_sid = s["session_id"], s["rl_session_id"]
    n_acks = len(inf.acks)
    with st.client(s["session_api_key"]) as c:
        first = c.post(f"/v1/sessions/{sid}/export", json={"remove_session": True})
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["count"] == len(body["rows"]) == 2 and body["export_id"]
        assert all(row["agent_session_id"] == sid for row in body["rows"])
        # The agent proxy did not acknowledge on the client's behalf: nothing is removed, and
        # a client that never acknowledges (it went away with the answer) loses nothing.
        assert len(inf.acks) == n_acks and rl_sid not in inf.removed
        again = c.post(f"/v1/sessions/{sid}/export", json={"remove_session": True})
        assert again.status_code == 200, again.text
        assert again.json()["rows"] == body["rows"]
        export_id = again.json()["export_id"]
        assert export_id != body["export_id"] and len(inf.acks) == n_acks
        # Another session's key may not acknowledge it, nor this session another's export.
        with st.client(other["session_api_key"]) as o:
            r = o.post(f"/v1/sessions/{sid}/ack_export", json={"export_id": export_id})
            assert r.status_code == 403, r.text
            theirs = o.post(
                f"/v1/sessions/{other['session_id']}/export", json={"remove_session": True}
            )
            assert theirs.status_code == 200 and theirs.json()["count"] == 2
        their_id = theirs.json()["export_id"]
        r = c.post(f"/v1/sessions/{sid}/ack_export", json={"export_id": their_id})
        assert r.status_code == 403, r.text
        assert other["rl_session_id"] not in inf.removed
        r = c.post(f"/v1/sessions/{sid}/ack_export", json={})
        assert r.status_code == 400, r.text
        # The acknowledgement removes the rows, with the RL session's own key.
        r = c.post(f"/v1/sessions/{sid}/ack_export", json={"export_id": export_id})
        assert r.status_code == 200, r.text
        assert r.json() == {"export_id": export_id, "removed": [sid], "kept": []}
        assert inf.acks[-1] == (export_id, f"areal-sk-{rl_sid}.s") and rl_sid in inf.removed
        r = c.post(f"/v1/sessions/{sid}/export", json={"remove_session": True})
        assert r.status_code == 200 and r.json()["count"] == 0, r.text
        # Idempotent: again, nothing more is removed.
        r = c.post(f"/v1/sessions/{sid}/ack_export", json={"export_id": export_id})
        assert r.status_code == 200 and r.json()["removed"] == [], r.text
    # The admin key acknowledges too.
    with st.client() as admin:
        r = admin.post(
            f"/v1/sessions/{other['session_id']}/ack_export",
            json={"export_id": their_id},
        )
        assert r.status_code == 200 and r.json()["removed"] == [other["session_id"]], r.text
