"""Agent mode without processes: event shapes, response ids, who a key is."""

from __future__ import annotations

import orjson
import pytest

from areal_gateway.agent.common import principal
from areal_gateway.agent.shapes import ChatShape, ResponsesShape, session_of_response
from areal_gateway.auth import Authenticator
from areal_runtime.errors import ServiceError
from areal_runtime.session_keys import mint_key


def _events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.splitlines()
        if not lines:
            continue
        assert lines[0].startswith("event: ")
        data = orjson.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: ")
        out.append(data)
    return out


def test_response_ids_name_their_session() -> None:
    shape = ResponsesShape("agent-abc_def", "agent", {}, None)
    assert session_of_response(shape.id) == "agent-abc_def"
    assert session_of_response("resp_x") is None and session_of_response("chatcmpl-1") is None


def test_responses_stream_and_whole_agree() -> None:
    shape = ResponsesShape("s1", "agent", {"session_id": "s1"}, None)
    raw = shape.start()
    raw += shape.event("delta", {"text": "Hel"}) + shape.event("delta", {"text": "lo"})
    raw += shape.event("tool_call", {"id": "c1", "name": "calc", "arguments": {"x": 1}})
    raw += shape.event("tool_result", {"id": "c1", "output": {"v": 2}})
    raw += shape.event("delta", {"text": "done"}) + shape.event("done", {})
    raw += shape.finish()
    events = _events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hel",
        "lo",
        "done",
    ]
    args = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert orjson.loads(args["arguments"]) == {"x": 1} and args["name"] == "calc"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][2]["output"] == '{"v":2}'
    assert orjson.loads(shape.whole())["output"] == final["output"]


def test_responses_failure_ends_with_error_and_failed() -> None:
    shape = ResponsesShape("s1", "agent", {}, None)
    raw = shape.start() + shape.event("delta", {"text": "a"})
    raw += shape.fail(ServiceError(500, "boom", type="agent_error", code="agent_error"))
    events = _events(raw)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "boom"
    assert events[-1]["response"]["error"] == {"code": "agent_error", "message": "boom"}


def test_chat_shape() -> None:
    shape = ChatShape("s1", "agent")
    raw = shape.start() + shape.event("delta", {"text": "hi"}) + shape.event("tool_call", {})
    raw += shape.finish()
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    chunks = [orjson.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = orjson.loads(shape.whole())
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == "hi"


class _Req:
    def __init__(self, auth: str | None) -> None:
        self.headers = {"authorization": auth} if auth else {}


class _Gw:
    auth = Authenticator("admin-key")


def test_principal() -> None:
    gw = _Gw()
    assert principal(gw, _Req("Bearer admin-key")).is_admin  # type: ignore[arg-type]
    key = mint_key("agent-1")
    p = principal(gw, _Req(f"Bearer {key}"))  # type: ignore[arg-type]
    assert not p.is_admin and p.session_id == "agent-1" and p.api_key == key
    for bad in (None, "Bearer ", "Basic admin-key", "Bearer other"):
        with pytest.raises(ServiceError) as e:
            principal(gw, _Req(bad))  # type: ignore[arg-type]
        assert e.value.http_status == 401


def test_responses_shape_echoes_the_request_store_flag():
    for store in (True, False):
        shape = ResponsesShape("s1", "agent", {}, None, store)
        shape.start()
        assert orjson.loads(shape.whole())["store"] is store


def test_chat_shape_maps_the_agents_tool_calls():
    shape = ChatShape("s1", "agent")
    raw = shape.start() + shape.event("delta", {"text": "Let me add. "})
    raw += shape.event("tool_call", {"id": "c1", "name": "calc", "arguments": {"x": 1}})
    raw += shape.event("tool_result", {"id": "c1", "output": {"v": 2}})
    raw += shape.event("delta", {"text": "It is 2."}) + shape.finish()
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    streamed = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x":1}'}}
    assert streamed == [{"index": 0, **call}]
    msg = orjson.loads(shape.whole())["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Let me add. It is 2.", "tool_calls": [call]}
