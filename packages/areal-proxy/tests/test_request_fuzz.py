"""Property: whatever chat or completion body arrives, the real ProxyServer answers it or
refuses it with a 400 naming the param, and the same way for a session key (whose requests
are recorded: lineage, chat template, SQLite) as for the admin key (recorded nowhere).

Found by this fuzz: a tool message with `"tool_calls": 5` passed validation (only assistant
messages had their tool calls checked) and then broke the recorder's lineage hash: a 500 for the
session key, a 400 (from the template) for the admin key.

Bounded for CI: a fixed number of examples, derandomized (the same bodies on every run), no
deadline (the shared CI machine is slow and noisy).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import grpc
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_fakes import EOS, FakeEngineClient, Harness, error_detail, request, start

from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.session_keys import mint_key, new_id

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Any JSON value, small.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def one_bad(valid: st.SearchStrategy[dict[str, Any]], keys: list[str]) -> st.SearchStrategy[Any]:
    """A well-formed object with at most one of `keys` set to any JSON value: the bad field
    gets past every other check and reaches the code behind them (the recorder, the chat
    template), where a check that is missing shows as a 500."""

    def spoil(base: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
        return {**base, key: value}

    return valid | st.builds(spoil, valid, st.sampled_from(keys), JSON)


TEXT = st.text(max_size=12)
ROLES = ["system", "user", "assistant", "tool", "developer", "function"]
CALL = one_bad(
    st.fixed_dictionaries(
        {
            "id": TEXT,
            "type": st.just("function"),
            "function": one_bad(
                st.fixed_dictionaries({"name": TEXT, "arguments": TEXT}), ["name", "arguments"]
            ),
        }
    ),
    ["id", "type", "function"],
)
MESSAGE = one_bad(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": TEXT
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        },
        optional={"tool_calls": st.lists(CALL, max_size=2), "name": TEXT, "tool_call_id": TEXT},
    ),
    ["role", "content", "tool_calls", "name", "tool_call_id"],
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3) | JSON},
    optional={
        "max_tokens": st.integers(-1, 8) | JSON,
        "temperature": JSON,
        "stop": JSON,
        "tools": JSON,
        "tool_choice": JSON,
        "logprobs": JSON,
        "top_logprobs": JSON,
        "stream_options": JSON,
        "chat_template_kwargs": JSON,
        "logit_bias": JSON,
    },
)
COMPLETION = st.fixed_dictionaries(
    {"prompt": TEXT | st.lists(st.integers(-2, 200), max_size=4) | JSON},
    optional={
        "max_tokens": st.integers(-1, 8) | JSON,
        "logprobs": JSON,
        "echo": JSON,
        "stop": JSON,
        "stop_token_ids": JSON,
        "seed": JSON,
    },
)


class _Loop:
    """The proxy under test in its own event loop thread, so hypothesis drives it from a plain
    (sync) test and one server serves every example."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[_Loop, Harness, str, str]]:
    bg = _Loop()
    h: Harness = bg.run(start(FakeEngineClient([5, 6, EOS])))
    sid = new_id("sess")
    key = mint_key(sid)

    async def group() -> None:
        creds = [proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)]
        await h.stub.StartSessions(
            proxy_pb2.StartSessionsRequest(task_id="fuzz", group_id="g-fuzz", sessions=creds)
        )

    bg.run(group())
    yield bg, h, sid, key
    bg.run(h.close())
    bg.close()


def _outcome(bg: _Loop, call: Any, body: dict[str, Any], **env: Any) -> tuple[int, str]:
    """(HTTP status, param) of one call: 200 or the error detail's status."""

    async def go() -> tuple[int, str]:
        try:
            resp = call(request(orjson.dumps(body), **env))
            if hasattr(resp, "__aiter__"):
                async for _ in resp:
                    pass
            else:
                await resp
        except grpc.aio.AioRpcError as exc:
            d = error_detail(exc)
            return d.http_status, d.param
        return 200, ""

    return bg.run(go())


def _check(served: tuple[_Loop, Harness, str, str], method: str, body: dict[str, Any]) -> None:
    bg, h, sid, key = served
    call = getattr(h.stub, method)
    admin = _outcome(bg, call, body, api_key="admin", is_admin=True)
    session = _outcome(bg, call, body, api_key=key, session_id=sid)
    assert admin[0] < 500, (admin, body)
    assert session[0] < 500, (session, body)
    assert admin == session, (admin, session, body)


@FUZZ
@given(body=CHAT)
def test_chat_bodies_never_5xx_and_agree_across_keys(served, body):
    _check(served, "ChatCompletion", body)


@FUZZ
@given(body=CHAT)
def test_chat_stream_bodies_never_5xx_and_agree_across_keys(served, body):
    _check(served, "ChatCompletionStream", body)


@FUZZ
@given(body=COMPLETION)
def test_completion_bodies_never_5xx_and_agree_across_keys(served, body):
    _check(served, "Completion", body)


def test_tool_message_with_non_list_tool_calls_is_a_400_for_both_keys(served):
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "tool", "content": "", "tool_calls": 5},
        ]
    }
    bg, h, sid, key = served
    for env in ({"api_key": "admin", "is_admin": True}, {"api_key": key, "session_id": sid}):
        assert _outcome(bg, h.stub.ChatCompletion, body, **env) == (400, "messages[1].tool_calls")
