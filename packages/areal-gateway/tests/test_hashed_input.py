"""Bad input in what the gateway hashes for routing (a prompt's prefix hashes) is a 400
naming the field, never a 500 from the hashing: every path, stream or not, either key kind
(checked with the body's other checks, so also where nothing is hashed: a session key's
requests go to its pin)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ADMIN_KEY, Stack

MODEL = "m-hashed"
HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}", "anthropic-version": "2023-06-01"}


def _deep(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


def _chat(message: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [message], "stream": stream}


CHAT_CASES = [
    # A text part whose text is not a string.
    ({"role": "user", "content": [{"type": "text", "text": True}]}, "messages[0].content[0].text"),
    # Nested deeper than a JSON writer goes (orjson's TypeError in the hashing).
    ({"role": _deep(300), "content": "hi"}, "messages[0].role"),
    (
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": _deep(300)}}]},
        "messages[0].tool_calls[0].function",
    ),
    ({"role": "user", "content": 5}, "messages[0].content"),
]


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    stack.register(MODEL)
    return MODEL


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("message", "param"), CHAT_CASES)
def test_chat_fields_that_are_hashed_are_checked(
    model: str, http, message: dict[str, Any], param: str, stream: bool
) -> None:
    r = http.post("/v1/chat/completions", json=_chat(message, stream), headers=HEADERS)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "Internal error" not in err["message"]


def test_messages_and_responses_name_the_field(model: str, http) -> None:
    part = {"type": "text", "text": True}
    r = http.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [part]}]},
        headers=HEADERS,
    )
    assert r.status_code == 400 and "messages.0.content.0.text" in r.json()["error"]["message"]
    part = {"type": "input_text", "text": True}
    r = http.post(
        "/v1/responses",
        json={"model": MODEL, "input": [{"role": "user", "content": [part]}]},
        headers=HEADERS,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].text"


def test_a_good_body_is_still_served(model: str, http) -> None:
    body = _chat({"role": "user", "content": [{"type": "text", "text": "hi"}]}, False)
    assert http.post("/v1/chat/completions", json=body, headers=HEADERS).status_code == 200


def test_a_session_key_gets_the_same_400(stack: Stack, model: str, http) -> None:
    stack.gw.gateway.auth.add_session_key("sess-key-hashed-abcdefghij", "session-hashed")
    body = _chat({"role": "user", "content": [{"type": "text", "text": True}]}, False)
    r = http.post(
        "/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sess-key-hashed-abcdefghij"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text"
