"""Property-based fuzz of chat and completion bodies through the real stack:
gateway -> router -> the real data proxy -> the shared SGLang engine (parrot model).

Every body is answered or refused with a 4xx, never a 5xx (nothing here is an outage: one
healthy replica, an idle engine), and a malformed one gets the same status and error
(message, type, code, param) with the admin key (recorded nowhere) as with a session key (recorded: lineage, chat template,
SQLite). A tool message with `"tool_calls": 5` was a 500 for the session key and a 400 for
the admin key.

Bounded for CI: derandomized, a fixed number of examples, at most 2 tokens generated each.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stack import ADMIN_KEY, start_stack, wait_healthy
from testpaths import PARROT

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)


def one_bad(valid: st.SearchStrategy[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[Any]:
    """Well-formed, or well-formed but for one of `keys` (any JSON): the bad field passes
    every other check and reaches the code behind them, where a missing check is a 5xx."""

    def spoil(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
        return {**base, key: value}

    return valid | st.builds(spoil, valid, st.sampled_from(keys), JSON)


CALL = one_bad(
    st.fixed_dictionaries(
        {
            "id": TEXT,
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT}),
        }
    ),
    ["id", "function"],
)
MESSAGE = one_bad(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT},
        optional={"tool_calls": st.lists(CALL, max_size=2), "tool_call_id": TEXT},
    ),
    ["role", "content", "tool_calls", "name", "tool_call_id"],
)
BASE = {"model": st.just(MODEL), "max_tokens": st.integers(1, 2), "stream": st.booleans()}
# Not max_tokens: spoiled to null it means "up to the context", a long generation per example.
SAMPLING = ["n", "temperature", "stop", "stream", "logprobs", "stream_options", "seed", "top_k"]
CHAT = one_bad(
    st.fixed_dictionaries({**BASE, "messages": st.lists(MESSAGE, min_size=1, max_size=3)}),
    [*SAMPLING, "messages", "tools", "tool_choice", "top_logprobs"],
)
COMPLETION = one_bad(
    st.fixed_dictionaries({**BASE, "prompt": TEXT | st.lists(st.integers(0, 60), max_size=4)}),
    [*SAMPLING, "prompt", "echo"],
)


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("fuzz"), sglang_engine.url, PARROT, n_proxies=1)
    wait_healthy(s, MODEL, 1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keys(stack) -> dict[str, str]:
    with stack.admin() as c:
        r = c.post("/rl/start_session", json={"task_id": "fuzz", "model": MODEL})
        assert r.status_code == 201, r.text
    return {"admin": ADMIN_KEY, "session": r.json()["sessions"][0]["session_api_key"]}


def _outcome(c: httpx.Client, path: str, key: str, body: Any) -> tuple[int, Any]:
    """(status, the whole OpenAI error object) of a refused body, (status, None) otherwise:
    one parser (areal_runtime.openai) answers at either hop, so the words agree too."""
    r = c.post(
        path,
        content=orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    if r.status_code >= 400:
        return r.status_code, r.json()["error"]
    if "text/event-stream" in r.headers.get("content-type", ""):
        # Checks run before the first chunk: a stream that started must not fail.
        assert '"error"' not in r.text, r.text
    return r.status_code, None


@pytest.mark.timeout(600)
@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), data=st.data())
def test_no_body_is_a_5xx_and_both_keys_agree(stack, keys, path: str, data: Any) -> None:
    body = data.draw(CHAT if "chat" in path else COMPLETION)
    with httpx.Client(base_url=stack.gateway_url, timeout=60) as c:
        got = {kind: _outcome(c, path, key, body) for kind, key in keys.items()}
    for kind, (status, _) in got.items():
        assert status < 500, (kind, path, body, got)
    assert got["admin"] == got["session"], (path, body, got)


def test_a_tool_message_with_bad_tool_calls_is_a_400_for_both_keys(stack, keys) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "tool", "content": "", "tool_calls": 5},
        ],
    }
    with httpx.Client(base_url=stack.gateway_url, timeout=60) as c:
        for key in keys.values():
            status, err = _outcome(c, "/v1/chat/completions", key, body)
            assert (status, err["param"]) == (400, "messages[1].tool_calls")
