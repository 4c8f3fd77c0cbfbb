"""ArealClient against a fake gateway (httpx.MockTransport): requests, results, errors."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

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
    APIStatusError,
    APITimeoutError,
    ArealClient,
    ArealClientError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ExportInterruptedError,
    ExportNotAcknowledgedError,
    InternalServerError,
    InvalidResponseError,
    NotFoundError,
    PartialFailureError,
    PermissionDeniedError,
    PromptPaths,
    RateLimitError,
    Session,
    SessionStatus,
    ToolCallCounts,
    Trajectory,
    prompt_hash,
)


@pytest.fixture
def gw() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def areal(gw: FakeGateway):
    with ArealClient(BASE + "/", ADMIN, transport=gw.transport()) as client:
        yield client


def _session(i: int = 0) -> Session:
    return Session(f"sess-{i}", f"areal-sk-sess-{i}.s{i}", "group-1", BASE)


# -- construction ---------------------------------------------------------------------


def test_admin_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_ADMIN_API_KEY", "from-env")
    gw = FakeGateway()
    gw.on("GET", "/v1/models", {"object": "list", "data": [{"id": "tiny"}]})
    with ArealClient(BASE, transport=gw.transport()) as c:
        assert c.served_models() == ["tiny"]
    assert bearer(gw.last) == "from-env"


def test_missing_admin_key_and_bad_url_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AREAL_ADMIN_API_KEY", raising=False)
    with pytest.raises(ValueError, match="AREAL_ADMIN_API_KEY"):
        ArealClient(BASE)
    with pytest.raises(ValueError, match="http"):
        ArealClient("gw.test:8080", ADMIN)


# -- RL API -----------------------------------------------------------------------------


def test_start_group_sends_admin_request_and_returns_typed_group(areal, gw) -> None:
    gw.on("POST", "/rl/start_session", group_answer(2), 201)
    group = areal.start_group(task_id="t-1", group_size=2, model="tiny")
    req = gw.last
    assert req.url == BASE + "/rl/start_session"
    assert bearer(req) == ADMIN
    assert req.headers["Content-Type"] == "application/json"
    assert req.headers["User-Agent"].startswith("areal-client/")
    assert gw.last_body() == {"task_id": "t-1", "group_size": 2, "model": "tiny"}
    assert (group.group_id, group.task_id, group.model) == ("group-1", "t-1", "tiny")
    assert [s.session_id for s in group.sessions] == ["sess-0", "sess-1"]
    s = group.sessions[1]
    assert s.api_key == "areal-sk-sess-1.s1" and s.group_id == "group-1"
    assert s.base_url == BASE and s.openai_base_url == BASE + "/v1"
    assert "areal-sk" not in repr(s)  # the key is a credential


def test_start_session_omits_model_when_not_given(areal, gw) -> None:
    gw.on("POST", "/rl/start_session", group_answer(1), 201)
    s = areal.start_session(task_id="t-1")
    assert gw.last_body() == {"task_id": "t-1", "group_size": 1}
    assert s.session_id == "sess-0"


@pytest.mark.parametrize("size", [0, -1, 1025, True, 2.0, "4"])
def test_bad_group_size_is_refused_before_sending(areal, gw, size) -> None:
    with pytest.raises(ValueError, match="group_size"):
        areal.start_group(task_id="t", group_size=size)
    assert gw.requests == []


def test_a_group_of_the_wrong_size_is_an_invalid_response(areal, gw) -> None:
    gw.on("POST", "/rl/start_session", group_answer(1), 201)
    with pytest.raises(InvalidResponseError, match="asked for 3 sessions, got 1"):
        areal.start_group(group_size=3)


def test_set_reward_with_a_session_uses_its_key(areal, gw) -> None:
    gw.on(
        "POST",
        "/rl/set_reward",
        {"session_id": "sess-0", "interaction_id": "chatcmpl-9", "reward": 0.5},
    )
    out = areal.set_reward(_session(0), 0.5, interaction_id="chatcmpl-9")
    assert bearer(gw.last) == "areal-sk-sess-0.s0"
    assert gw.last_body() == {"reward": 0.5, "interaction_id": "chatcmpl-9"}
    assert (out.session_id, out.interaction_id, out.reward) == ("sess-0", "chatcmpl-9", 0.5)


def test_set_reward_with_a_session_id_uses_the_admin_key(areal, gw) -> None:
    gw.on("POST", "/rl/set_reward", {"session_id": "sess-3", "interaction_id": "c", "reward": 1})
    out = areal.set_reward("sess-3", 1)
    assert bearer(gw.last) == ADMIN
    assert gw.last_body() == {"reward": 1.0, "session_id": "sess-3"}
    assert out.reward == 1.0 and isinstance(out.reward, float)


@pytest.mark.parametrize("reward", [math.nan, math.inf, "1", None, True])
def test_bad_reward_is_refused_before_sending(areal, gw, reward) -> None:
    with pytest.raises(ValueError, match="reward"):
        areal.set_reward(_session(), reward)
    with pytest.raises(ValueError, match="Session"):
        areal.set_reward("", 1.0)
    assert gw.requests == []


def test_end_session_by_key_and_by_id(areal, gw) -> None:
    gw.on("POST", "/rl/end_session", {"ended": 1})
    assert areal.end_session(_session(0)) == 1
    assert bearer(gw.last) == "areal-sk-sess-0.s0" and gw.last_body() == {}
    assert areal.end_session("sess-7") == 1
    assert bearer(gw.last) == ADMIN and gw.last_body() == {"session_ids": ["sess-7"]}


def test_session_status_by_key_and_by_id(areal, gw) -> None:
    gw.on("GET", "/rl/sessions/sess-0", status_answer("sess-0"))
    st = areal.session_status(_session(0))
    req = gw.last
    assert (req.method, req.url) == ("GET", BASE + "/rl/sessions/sess-0")
    assert bearer(req) == "areal-sk-sess-0.s0" and req.content == b""
    assert "Content-Type" not in req.headers
    assert st == SessionStatus(
        session_id="sess-0",
        group_id="group-1",
        task_id="t-1",
        model="tiny",
        created_at=1700000000.5,
        last_active_at=1700000009.0,
        ended=False,
        interactions=4,
        prompt=PromptPaths(
            incremental=2,
            full=2,
            fallbacks={"history_edited": 1},
            cached=True,
            last_prompt_tokens=57,
        ),
    )
    assert isinstance(st.last_active_at, float)
    # A session id: the admin key reads it; nothing cached, and ended.
    prompt = {**status_answer()["prompt"], "cached": False, "last_prompt_tokens": None}
    gw.on("GET", "/rl/sessions/sess-7", status_answer("sess-7", ended=True, prompt=prompt))
    st = areal.session_status("sess-7")
    assert bearer(gw.last) == ADMIN
    assert st.ended and st.prompt.last_prompt_tokens is None and not st.prompt.cached
    with pytest.raises(ValueError, match="Session"):
        areal.session_status("")


def test_session_status_errors(areal, gw) -> None:
    forbidden = {
        "error": {"message": "no", "type": "permission_error", "code": "forbidden_session"}
    }
    gw.on("GET", "/rl/sessions/sess-1", forbidden, 403)
    with pytest.raises(PermissionDeniedError) as info:
        areal.session_status("sess-1")
    assert info.value.code == "forbidden_session"
    # An id is one path segment, whatever it holds.
    with pytest.raises(NotFoundError):
        areal.session_status("a/b?c")
    assert gw.last.url.raw_path == b"/rl/sessions/a%2Fb%3Fc"
    for bad, match in [
        (status_answer(interactions="4"), "'interactions' should be int"),
        (status_answer(ended=1), "'ended' should be bool"),
        (status_answer(prompt=None), "'prompt' should be dict"),
        (status_answer(prompt={**status_answer()["prompt"], "fallbacks": {"x": 1.5}}), "x"),
        ({k: v for k, v in status_answer().items() if k != "model"}, "missing field 'model'"),
    ]:
        gw.on("GET", "/rl/sessions/sess-2", bad)
        with pytest.raises(InvalidResponseError, match=match):
            areal.session_status("sess-2")


def test_export_by_group_returns_typed_rows(areal, gw) -> None:
    extra = row(1, agent_session_id="agent-1", future_field={"kept": True})
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0), extra))
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0", "sess-1"]))
    result = areal.export(group_id="group-1", style="concat", discount=0.9, remove_session=True)
    export, ack = gw.requests
    assert bearer(export) == ADMIN
    assert "x-ndjson" not in export.headers.get("Accept", "")
    # Removal is the acknowledgement, sent once the whole answer was read, with the same key.
    assert (ack.url.path, bearer(ack), json.loads(ack.content)) == (
        "/rl/ack_export",
        ADMIN,
        {"export_id": EXPORT_ID},
    )
    assert result.export_id == EXPORT_ID
    assert json.loads(export.content) == {
        "group_id": "group-1",
        "style": "concat",
        "side_calls": "include",
        "discount": 0.9,
        "remove_session": True,
    }
    assert result.count == len(result) == 2
    first, second = result
    assert isinstance(first, Trajectory)
    assert first.input_ids == [1, 2, 3, 4] and first.loss_mask == [0, 0, 1, 1]
    assert first.logprobs == [0.0, 0.0, -0.5, -0.25] and first.versions == [-1, -1, 3, 3]
    assert first.output_versions == [3, 3]
    assert (first.session_id, first.interaction_id, first.reward) == ("sess-0", "chatcmpl-0", 0.0)
    assert (first.response_id, first.choice_index, first.finish_reason) == ("chatcmpl-0", 0, "stop")
    assert first.agent_session_id is None and "agent_session_id" not in first.to_dict()
    assert second.agent_session_id == "agent-1"
    assert first.extra == {} and second.extra == {"future_field": {"kept": True}}
    assert first.to_dict() == row(0)
    assert second.to_dict() == extra  # round trip, unknown fields kept
    assert (first.chain_id, first.chain_reason, first.parent_chain, first.side) == (
        "chatcmpl-0",
        "root",
        "",
        False,
    )
    assert first.tool_calls == ToolCallCounts(declared=1, called=1, parsed=1)
    assert first.uncertified_spans() == []


def test_a_row_checks_its_spans_against_its_prompt_hashes() -> None:
    ok = Trajectory.from_json(row(0))
    assert ok.spans == [(2, 4, prompt_hash([1, 2]))] and ok.uncertified_spans() == []
    # A prefix that is not what the span was sampled under, or a span with no hash.
    changed = Trajectory.from_json(row(0, input_ids=[1, 9, 3, 4]))
    assert changed.uncertified_spans() == ok.spans
    assert Trajectory.from_json(row(0, spans=[[2, 4, ""]])).uncertified_spans() == [(2, 4, "")]
    # The hash itself: BLAKE2b-128 of the ids as int32 little-endian.
    packed = b"".join(i.to_bytes(4, "little") for i in (1, 2))
    assert prompt_hash([1, 2]) == hashlib.blake2b(packed, digest_size=16).hexdigest()


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"side": 0}, "'side' should be bool"),
        ({"spans": [[2, 4]]}, "spans"),
        ({"spans": [[2, "4", "h"]]}, "spans"),
        ({"tool_calls": {"declared": 1, "called": 1}}, "parsed"),
        ({"tool_calls": [1, 1, 1]}, "tool_calls"),
        ({"parent_chain": None}, "parent_chain"),
    ],
)
def test_a_row_with_a_malformed_chain_field_is_refused(over: dict, match: str) -> None:
    with pytest.raises(InvalidResponseError, match=match):
        Trajectory.from_json(row(0, **over))


def test_export_passes_the_side_calls_choice(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", {"count": 0, "rows": []})
    areal.export(group_id="g", side_calls="exclude")
    assert gw.last_body()["side_calls"] == "exclude"
    # One row per chain unless asked otherwise.
    assert gw.last_body()["style"] == "concat"


def test_export_by_session_ids_or_own_session(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", {"count": 0, "rows": []})
    assert areal.export(session_ids=["sess-1", "sess-2"]).rows == []
    assert bearer(gw.last) == ADMIN
    assert gw.last_body()["session_ids"] == ["sess-1", "sess-2"]
    areal.export(session=_session(4))
    assert bearer(gw.last) == "areal-sk-sess-4.s4"
    assert gw.last_body()["session_ids"] == ["sess-4"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"group_id": "g", "session_ids": ["s"]}, "exactly one"),
        ({"group_id": "g", "style": "flat"}, "style"),
        ({"group_id": "g", "side_calls": "some"}, "side_calls"),
        ({"group_id": "g", "discount": 1.5}, "discount"),
        ({"group_id": "g", "remove_session": "yes"}, "remove_session"),
        ({"session_ids": ["ok", ""]}, "session_ids"),
    ],
)
def test_bad_export_arguments_are_refused(areal, gw, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        areal.export(**kwargs)
    with pytest.raises(ValueError, match=match):
        areal.iter_export(**kwargs)  # checked eagerly, before the first row is asked for
    assert gw.requests == []


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (row(0, loss_mask=[0, 1]), "differ in length"),
        ({k: v for k, v in row(0).items() if k != "input_ids"}, "missing field 'input_ids'"),
        (row(0, reward="high"), "'reward' should be int or float"),
        (row(0, reward=True), "'reward' should be int or float"),
        (row(0, input_ids="1,2,3"), "'input_ids' should be list"),
        (row(0, session_id=7), "'session_id' should be str"),
        ({k: v for k, v in row(0).items() if k != "response_id"}, "missing field 'response_id'"),
        (row(0, choice_index=True), "'choice_index' should be int"),
        (row(0, finish_reason=None), "'finish_reason' should be str"),
        ({k: v for k, v in row(0).items() if k != "replicas"}, "missing field 'replicas'"),
        (row(0, replicas=[2, "p"]), "'replicas' should hold \\[integer, string\\] pairs"),
        (row(0, replicas=[[True, "p"]]), "'replicas' should hold"),
        (row(0, replicas=[[2, "p", 3]]), "'replicas' should hold"),
        (row(0, replicas=[[2, None]]), "'replicas' should hold"),
        (row(0, agent_session_id=None), "'agent_session_id' should be str"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_rows_are_invalid_responses(areal, gw, bad, match) -> None:
    gw.on("POST", "/rl/export_trajectories", {"count": 1, "rows": [bad]})
    with pytest.raises(InvalidResponseError, match=match):
        areal.export(group_id="g")


def test_export_count_must_match_rows(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", {"count": 3, "rows": [row(0)]})
    with pytest.raises(InvalidResponseError, match="count"):
        areal.export(group_id="g")


# -- NDJSON export ------------------------------------------------------------------------


def _ndjson(*lines: bytes, export_id: str = "") -> httpx.Response:
    headers = {"Content-Type": "application/x-ndjson"}
    if export_id:
        headers["X-Areal-Export-Id"] = export_id
    return httpx.Response(200, content=b"".join(lines), headers=headers)


def test_iter_export_asks_for_json_lines_and_yields_rows(areal, gw) -> None:
    body = (json.dumps(row(0)) + "\n\n" + json.dumps(row(1)) + "\n").encode()
    gw.on("POST", "/rl/export_trajectories", _ndjson(body, export_id=EXPORT_ID))
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0", "sess-1"]))
    rows = []
    for r in areal.iter_export(group_id="group-1", remove_session=True):
        # Nothing is acknowledged while rows are still being read.
        assert [q.url.path for q in gw.requests] == ["/rl/export_trajectories"]
        rows.append(r)
    export, ack = gw.requests
    assert export.headers["Accept"] == "application/x-ndjson"
    assert json.loads(export.content)["remove_session"] is True
    assert ack.url.path == "/rl/ack_export" and json.loads(ack.content) == {"export_id": EXPORT_ID}
    assert [r.interaction_id for r in rows] == ["chatcmpl-0", "chatcmpl-1"]
    assert rows[1].to_dict() == row(1)


def test_iter_export_stopped_early_or_cut_acknowledges_nothing(areal, gw) -> None:
    body = b"".join(json.dumps(row(i)).encode() + b"\n" for i in range(3))
    gw.on("POST", "/rl/export_trajectories", _ndjson(body, export_id=EXPORT_ID))
    gw.on("POST", "/rl/ack_export", ack_answer([]))
    rows = areal.iter_export(group_id="group-1", remove_session=True)
    next(rows)
    rows.close()  # the trainer stopped after one row: its sessions must stay
    err = {"error": {"message": "proxy p1 went away", "type": "api_error", "code": "upstream"}}
    gw.on(
        "POST",
        "/rl/export_trajectories",
        _ndjson(body, json.dumps(err).encode() + b"\n", export_id=EXPORT_ID),
    )
    with pytest.raises(ExportInterruptedError):
        list(areal.iter_export(group_id="group-1", remove_session=True))
    assert [q.url.path for q in gw.requests] == ["/rl/export_trajectories"] * 2


def test_a_failed_ack_keeps_the_rows_for_the_caller(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0)))
    gw.on(
        "POST",
        "/rl/ack_export",
        {"error": {"message": "proxy down", "type": "api_error", "code": "unavailable"}},
        503,
    )
    with pytest.raises(ExportNotAcknowledgedError) as info:
        areal.export(group_id="group-1", remove_session=True)
    assert info.value.export_id == EXPORT_ID
    assert [r.session_id for r in info.value.result] == ["sess-0"]
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0"], kept=["sess-9"]))
    ack = areal.ack_export(info.value.export_id)
    assert (ack.removed, ack.kept) == (["sess-0"], ["sess-9"])


def test_export_with_removal_unacknowledged_leaves_the_ack_to_the_caller(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0), row(1)))
    gw.on("POST", "/rl/ack_export", ack_answer(["sess-0", "sess-1"]))
    result = areal.export(group_id="group-1", remove_session=True, acknowledge=False)
    # Only the export went out: nothing is removed until the caller acknowledges.
    assert [q.url.path for q in gw.requests] == ["/rl/export_trajectories"]
    assert gw.last_body()["remove_session"] is True
    assert result.export_id == EXPORT_ID and result.count == 2
    ack = areal.ack_export(result.export_id, session=None)
    assert ack.removed == ["sess-0", "sess-1"]
    assert [q.url.path for q in gw.requests] == ["/rl/export_trajectories", "/rl/ack_export"]
    assert json.loads(gw.last.content) == {"export_id": EXPORT_ID}
    # Without removal there is nothing to acknowledge either way; a non-boolean is refused.
    gw.on("POST", "/rl/export_trajectories", {"count": 0, "rows": []})
    assert areal.export(group_id="group-1", acknowledge=False).export_id is None
    with pytest.raises(ValueError, match="acknowledge"):
        areal.export(group_id="group-1", remove_session=True, acknowledge="no")
    # An answer without the id to acknowledge is refused as with acknowledge=True.
    gw.on("POST", "/rl/export_trajectories", {"count": 1, "rows": [row(0)]})
    with pytest.raises(InvalidResponseError, match="no export_id"):
        areal.export(group_id="group-1", remove_session=True, acknowledge=False)
    assert [q.url.path for q in gw.requests].count("/rl/ack_export") == 1


def test_an_export_with_removal_but_no_export_id_is_an_invalid_response(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", {"count": 1, "rows": [row(0)]})
    with pytest.raises(InvalidResponseError, match="no export_id"):
        areal.export(group_id="group-1", remove_session=True)


def test_iter_export_error_line_raises_after_the_rows_before_it(areal, gw) -> None:
    err = {"error": {"message": "proxy p1 went away", "type": "api_error", "code": "upstream"}}
    gw.on(
        "POST",
        "/rl/export_trajectories",
        _ndjson(json.dumps(row(0)).encode() + b"\n", json.dumps(err).encode() + b"\n"),
    )
    got = []
    with pytest.raises(ExportInterruptedError) as info:
        for r in areal.iter_export(session_ids=["sess-0", "sess-1"]):
            got.append(r)
    assert [r.session_id for r in got] == ["sess-0"]
    assert info.value.rows_read == 1 and info.value.code == "upstream"
    assert "proxy p1 went away" in str(info.value)


def test_iter_export_error_status_is_a_typed_error(areal, gw) -> None:
    gw.on(
        "POST",
        "/rl/export_trajectories",
        {
            "error": {
                "message": "no group 'g'",
                "type": "not_found_error",
                "code": "group_not_found",
            }
        },
        404,
    )
    with pytest.raises(NotFoundError) as info:
        list(areal.iter_export(group_id="g"))
    assert info.value.code == "group_not_found" and info.value.message == "no group 'g'"


def test_iter_export_line_that_is_not_json(areal, gw) -> None:
    gw.on("POST", "/rl/export_trajectories", _ndjson(b"<html>\n"))
    with pytest.raises(InvalidResponseError, match="line 0 is not JSON"):
        list(areal.iter_export(group_id="g"))


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (404, NotFoundError),
        (409, ConflictError),
        (413, APIStatusError),
        (429, RateLimitError),
        (502, InternalServerError),
        (503, InternalServerError),
    ],
)
def test_openai_shaped_errors_map_to_typed_errors(areal, gw, status, cls) -> None:
    err = {"message": "bad thing", "type": "some_type", "code": "some_code", "param": "model"}
    gw.on("POST", "/rl/start_session", {"error": err}, status)
    with pytest.raises(cls) as info:
        areal.start_group(task_id="t")
    e = info.value
    assert isinstance(e, APIStatusError) and isinstance(e, ArealClientError)
    assert (e.status, e.message, e.code, e.type, e.param) == (
        status,
        "bad thing",
        "some_code",
        "some_type",
        "model",
    )
    assert str(e) == f"POST /rl/start_session: HTTP {status}: bad thing (some_code)"


def test_an_error_body_that_is_not_the_gateways_shows_its_text(areal, gw) -> None:
    gw.on("GET", "/admin/workers", httpx.Response(502, text="<h1>Bad   Gateway</h1>\n"))
    with pytest.raises(InternalServerError) as info:
        areal.list_workers()
    assert info.value.message == "<h1>Bad Gateway</h1>" and info.value.code is None


def test_a_success_that_is_not_json_is_an_invalid_response(areal, gw) -> None:
    gw.on("GET", "/admin/models", httpx.Response(200, text="hello"))
    with pytest.raises(InvalidResponseError, match="not JSON"):
        areal.list_models()


def test_connection_failures_and_timeouts(gw) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with ArealClient(BASE, ADMIN, transport=httpx.MockTransport(refuse)) as c:
        with pytest.raises(APIConnectionError) as info:
            c.start_group()
        assert not isinstance(info.value, APITimeoutError)
        assert "ConnectError" in str(info.value) and info.value.path == "/rl/start_session"
        with pytest.raises(APIConnectionError):
            list(c.iter_export(group_id="g"))
    with (
        ArealClient(BASE, ADMIN, transport=httpx.MockTransport(slow)) as c,
        pytest.raises(APITimeoutError),
    ):
        c.update_weights("/ckpt")


# -- generation control -------------------------------------------------------------------


def test_control_calls_send_their_bodies(areal, gw) -> None:
    for action in ("pause", "continue", "set_version", "update_weights"):
        gw.on("POST", f"/admin/{action}", control_answer(action))
    assert areal.pause(model="tiny").action == "pause"
    assert gw.last_body() == {"model": "tiny"}
    areal.resume(worker="p0")
    assert gw.last.url.path == "/admin/continue" and gw.last_body() == {"worker": "p0"}
    areal.set_version(7)
    assert gw.last_body() == {"version": 7}
    result = areal.update_weights("/ckpt/step-3", version=4)
    assert gw.last_body() == {"path": "/ckpt/step-3", "version": 4}
    assert bearer(gw.last) == ADMIN
    assert result.ok and result.version == 4
    [w] = result.workers
    assert (w.proxy_id, w.model, w.paused, w.version, w.error) == ("p0", "tiny", False, 4, None)


@pytest.mark.parametrize("version", [-1, True, "3"])
def test_bad_versions_and_paths_are_refused(areal, gw, version) -> None:
    with pytest.raises(ValueError, match="version"):
        areal.set_version(version)
    with pytest.raises(ValueError, match="version"):
        areal.update_weights("/ckpt", version=version)
    with pytest.raises(ValueError, match="path"):
        areal.update_weights("")
    assert gw.requests == []


def test_partial_control_failure_raises_with_every_workers_outcome(areal, gw) -> None:
    gw.on(
        "POST",
        "/admin/update_weights",
        control_answer(
            "update_weights",
            {"proxy_id": "p0", "model": "tiny", "paused": False, "version": 5, "message": ""},
            {"proxy_id": "p1", "model": "tiny", "error": "engine refused the checkpoint"},
        ),
        207,
    )
    with pytest.raises(PartialFailureError) as info:
        areal.update_weights("/ckpt")
    e = info.value
    assert e.status == 207 and "p1: engine refused the checkpoint" in e.message
    assert e.result.version == 5 and not e.result.ok
    assert [w.ok for w in e.result.workers] == [True, False]


def test_control_failing_on_every_worker_names_their_errors(areal, gw) -> None:
    gw.on(
        "POST",
        "/admin/pause",
        control_answer("pause", {"proxy_id": "p0", "model": "tiny", "error": "unreachable"}),
        503,
    )
    with pytest.raises(InternalServerError) as info:
        areal.pause()
    assert info.value.status == 503 and info.value.message == "p0: unreachable"


# -- admin listings -----------------------------------------------------------------------


def test_list_models_and_workers(areal, gw) -> None:
    worker = {
        "proxy_id": "tiny-data-proxy-0",
        "address": "127.0.0.1:5001",
        "health": "healthy",
        "inflight_requests": 2,
        "inflight_tokens": 40,
        "sessions": 3,
    }
    gw.on(
        "GET",
        "/admin/models",
        {
            "models": [
                {
                    "name": "gpt",
                    "kind": "external",
                    "created": 5,
                    "base_url": "https://x/v1",
                    "upstream_model": "gpt-4o",
                    "workers": [],
                },
                {"name": "tiny", "kind": "internal", "created": 6, "workers": [worker]},
            ]
        },
    )
    gw.on(
        "GET",
        "/admin/workers",
        {
            "workers": [
                {
                    **worker,
                    "model": "tiny",
                    "kind": "inference",
                    "last_seen_unix_ms": 9,
                    "last_error": "",
                    "labels": {"rank": "0"},
                }
            ]
        },
    )
    ext, tiny = areal.list_models()
    assert bearer(gw.last) == ADMIN
    assert (ext.kind, ext.base_url, ext.upstream_model, ext.workers) == (
        "external",
        "https://x/v1",
        "gpt-4o",
        [],
    )
    [mw] = tiny.workers
    assert (mw.proxy_id, mw.health, mw.inflight_tokens, mw.sessions) == (
        "tiny-data-proxy-0",
        "healthy",
        40,
        3,
    )
    assert tiny.base_url is None
    [w] = areal.list_workers()
    assert (w.model, w.kind, w.address, w.labels) == (
        "tiny",
        "inference",
        "127.0.0.1:5001",
        {"rank": "0"},
    )


def test_health_needs_no_key(areal, gw) -> None:
    gw.on("GET", "/health", {"status": "ok"})
    assert areal.health() == {"status": "ok"}
    assert "Authorization" not in gw.last.headers
    gw.on("GET", "/health", ["ok"])
    with pytest.raises(InvalidResponseError, match="/health"):
        areal.health()


# -- the OpenAI SDK helper ----------------------------------------------------------------


def test_session_openai_is_bound_to_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    openai = pytest.importorskip("openai")
    s = _session(2)
    sync, aio = s.openai(max_retries=0), s.async_openai(max_retries=0)
    assert isinstance(sync, openai.OpenAI) and isinstance(aio, openai.AsyncOpenAI)
    for c in (sync, aio):
        assert str(c.base_url).rstrip("/") == BASE + "/v1"
        assert c.api_key == "areal-sk-sess-2.s2"
    monkeypatch.setitem(sys.modules, "openai", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"areal-client\[openai\]"):
        s.openai()


def test_a_worker_listing_of_the_wrong_shape_is_an_invalid_response(areal, gw) -> None:
    gw.on(
        "GET",
        "/admin/workers",
        {
            "workers": [
                {
                    "proxy_id": "p0",
                    "address": "h:1",
                    "model": "m",
                    "health": "healthy",
                    "inflight_requests": "lots",
                }
            ]
        },
    )
    with pytest.raises(InvalidResponseError, match="'inflight_requests' should be int"):
        areal.list_workers()


# -- admission ------------------------------------------------------------------------


def _refusal(code: str = "capacity_exhausted", retry_after: str = "2") -> httpx.Response:
    body = {"error": {"message": "full", "type": "rate_limit_error", "code": code, "param": None}}
    return httpx.Response(429, json=body, headers={"Retry-After": retry_after})


def test_a_refused_start_is_a_rate_limit_error_with_its_retry_after(areal, gw) -> None:
    gw.on("POST", "/rl/start_session", _refusal("staleness_bound", "3"))
    with pytest.raises(RateLimitError) as exc:
        areal.start_session(model="tiny", wait_s=1.5)
    assert exc.value.code == "staleness_bound" and exc.value.retry_after == 3.0
    assert gw.last_body() == {"task_id": "", "group_size": 1, "model": "tiny", "wait_s": 1.5}


@pytest.mark.parametrize("wait_s", [-1, 601, True, "1", math.nan])
def test_a_bad_wait_is_refused_before_sending(areal, gw, wait_s) -> None:
    with pytest.raises(ValueError, match="wait_s"):
        areal.start_group(group_size=1, wait_s=wait_s)
    assert gw.requests == []


def test_start_when_admitted_retries_after_retry_after_until_admitted(
    areal, gw, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("areal_client.client.sleep", slept.append)
    answers = [_refusal(), _refusal(), httpx.Response(201, json=group_answer(2))]
    gw.on("POST", "/rl/start_session", lambda request: answers.pop(0))
    group = areal.start_group_when_admitted(group_size=2, max_wait_s=30)
    assert len(group.sessions) == 2 and slept == [2.0, 2.0]
    # Every try asks the gateway to wait for room with what is left of the deadline.
    waits = [json.loads(r.content)["wait_s"] for r in gw.requests]
    assert all(0 < w <= 30 for w in waits)


def test_start_when_admitted_gives_up_at_its_deadline(areal, gw) -> None:
    gw.on("POST", "/rl/start_session", _refusal(retry_after="1"))
    with pytest.raises(RateLimitError):
        areal.start_session_when_admitted(max_wait_s=0.3)
    assert 1 <= len(gw.requests) <= 2


def test_end_session_names_a_failure(areal, gw) -> None:
    gw.on("POST", "/rl/end_session", {"ended": 1})
    areal.end_session(_session(0), failure="engine_refusal")
    assert gw.last_body() == {"failure": "engine_refusal"}
    areal.end_session("sess-7", failure="timeout")
    assert gw.last_body() == {"session_ids": ["sess-7"], "failure": "timeout"}
    with pytest.raises(ValueError, match="failure"):
        areal.end_session("sess-7", failure="Crashed badly!")


def test_export_selection_is_sent_and_the_summary_parsed(areal, gw) -> None:
    from areal_client import ExportSelection

    summary = {
        "version": 4,
        "exported": 1,
        "marked_stale": 0,
        "dropped_stale": 2,
        "masked_tokens": 0,
        "dropped_groups": 1,
        "dropped_group_rows": 3,
        "dropped_failed_rows": 1,
        "failed": [{"session_id": "sess-1", "group_id": "g", "failure": "timeout"}],
        "staleness": {"1": 1},
    }
    gw.on("POST", "/rl/export_trajectories", {"count": 1, "rows": [row(0)], "summary": summary})
    result = areal.export(
        group_id="g", selection=ExportSelection(max_staleness=1, min_usable_group_size=2)
    )
    body = gw.last_body()
    assert (body["max_staleness"], body["min_usable_group_size"]) == (1, 2)
    # Defaults are not sent: an older gateway gets the request it always got.
    assert "stale" not in body and "drop_incomplete_group" not in body
    assert result.summary is not None and result.summary.staleness == {1: 1}
    assert result.summary.failed[0].failure == "timeout" and result.summary.dropped_stale == 2
    gw.on("POST", "/rl/export_trajectories", export_answer(row(0)))
    assert areal.export(group_id="g").summary is None
    assert "max_staleness" not in gw.last_body()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"stale": "keep"}, "stale"),
        ({"mask_stale_tokens": True}, "needs max_staleness"),
        ({"drop_incomplete_group": True, "min_usable_group_size": 2}, "not both"),
        ({"min_usable_group_size": True}, "min_usable_group_size"),
    ],
)
def test_bad_export_selections_are_refused(kwargs, match) -> None:
    from areal_client import ExportSelection

    with pytest.raises(ValueError, match=match):
        ExportSelection(**kwargs)
