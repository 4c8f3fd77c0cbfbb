"""What coding-agent harnesses (Claude Code 2.1) send on `POST /v1/messages`, beyond the
plain Messages API: keep-all context edits, system messages inside `messages`, effort and
thinking display, deferred and server tools, failed tool results, the `?beta=true` query
and `anthropic-beta` header; and `POST /v1/messages/count_tokens`.

The shapes here are minimal ones of our own, not a harness's captured requests. Through the
gateway they use test_anthropic.py's SCRIPTED proxy (its models and its CountTokens).
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, Stack
from fakes import serve_models
from test_anthropic import MODELS, WEATHER, ScriptedProxy, _assert_error, _events, _post, _sdk

from areal_gateway.anthropic.request import translate
from areal_runtime.errors import InvalidRequest

KEEP_ALL = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
DEFERRED = {
    "name": "load_skill",
    "description": "Load a skill.",
    "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}},
    "defer_loading": True,
}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> Any:
    proxy = ScriptedProxy()
    server = serve_models(stack, proxy, MODELS)
    yield proxy
    stack.bg.run(server.stop(None))


def _doc(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}


def _refused(doc: dict[str, Any], *words: str) -> str:
    with pytest.raises(InvalidRequest) as ei:
        translate(doc)
    assert ei.value.http_status == 400
    for w in words:
        assert w in ei.value.message, ei.value.message
    return ei.value.message


def _assistant_thinking(text: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": text, "signature": ""},
            {"type": "text", "text": "ok"},
        ],
    }


# --- the translation, without processes ---------------------------------------------------


def test_a_claude_code_shaped_first_request_translates() -> None:
    doc = {
        "model": "m",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are an agent."},
            {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>"},
                    {"type": "text", "text": "Do it."},
                ],
            },
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "cwd: /w", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ],
        "tools": [WEATHER, DEFERRED],
        "metadata": {"user_id": '{"session_id": "s1"}'},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": KEEP_ALL,
        "output_config": {"effort": "high"},
    }
    t = translate(doc)
    assert t.chat["messages"] == [
        {"role": "system", "content": "You are an agent.\nUse tools."},
        {"role": "user", "content": "<reminder>\nDo it."},
        {"role": "system", "content": "cwd: /w"},  # in place, after the last user turn
    ]
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["get_weather"]
    assert t.chat["chat_template_kwargs"] == {"reasoning_effort": "high"}
    assert t.context_management and t.system_at == [1] and not t.left_out
    assert t.stream and t.chat["max_tokens"] == 32000


@pytest.mark.parametrize(
    "cm",
    [
        KEEP_ALL,
        {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}]},
        # Anthropic's default keeps the last turn's thinking: one thinking turn, nothing cleared.
        {"edits": [{"type": "clear_thinking_20251015"}]},
        {
            "edits": [
                {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}
            ]
        },
        {"edits": []},
        {},
    ],
)
def test_context_edits_that_remove_nothing_are_accepted(cm: dict[str, Any]) -> None:
    doc = _doc(
        messages=[
            {"role": "user", "content": "a"},
            _assistant_thinking("think once"),
            {"role": "user", "content": "b"},
        ],
        context_management=cm,
    )
    t = translate(doc)
    # The conversation is the one sent: the thinking is still there.
    assert t.chat["messages"][1]["reasoning_content"] == "think once"
    assert t.context_management


def test_context_edits_that_would_remove_something_are_a_400_naming_them() -> None:
    two = [
        {"role": "user", "content": "a"},
        _assistant_thinking("one"),
        {"role": "user", "content": "b"},
        _assistant_thinking("two"),
        {"role": "user", "content": "c"},
    ]
    _refused(
        _doc(messages=two, context_management={"edits": [{"type": "clear_thinking_20251015"}]}),
        "context_management.edits.0.keep",
        "last 1 assistant turn",
        "1 earlier one",
        "keep: 'all'",
    )
    _refused(
        _doc(
            context_management={
                "edits": [KEEP_ALL["edits"][0], {"type": "clear_tool_uses_20250919"}]
            }
        ),
        "context_management.edits.1.type",
        "'clear_tool_uses_20250919'",
        "edits no context",
    )
    _refused(
        _doc(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}),
        "context_management.edits.0.keep",
    )
    _refused(_doc(context_management={"edits": "all"}), "context_management.edits")
    _refused(_doc(context_management={"compact": True}), "context_management.compact")


def test_system_messages_stay_in_place_even_between_a_tool_use_and_its_result() -> None:
    t = translate(
        _doc(
            messages=[
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}
                    ],
                },
                {"role": "system", "content": "Note: tools are slow."},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sun"}],
                },
                {"role": "system", "content": "Answer briefly."},
            ]
        )
    )
    assert [m["role"] for m in t.chat["messages"]] == [
        "user",
        "assistant",
        "system",
        "tool",
        "system",
    ]
    assert t.system_at == [2, 4]


@pytest.mark.parametrize(
    ("content", "is_error", "model_reads"),
    [
        ("command not found", True, "Error: command not found"),
        ([{"type": "text", "text": "exit 1"}], True, "Error: exit 1"),
        ("Error: already says so", True, "Error: already says so"),
        ("  error - lower case too", True, "  error - lower case too"),
        ("", True, "Error"),
        ("command not found", False, "command not found"),
        ("command not found", None, "command not found"),
    ],
)
def test_a_failed_tool_result_reads_as_an_error(
    content: Any, is_error: bool | None, model_reads: str
) -> None:
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": "c1", "content": content}
    if is_error is not None:
        result["is_error"] = is_error
    t = translate(
        _doc(
            messages=[
                {"role": "user", "content": "run it"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "sh", "input": {}}],
                },
                {"role": "user", "content": [result]},
            ]
        )
    )
    assert t.chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": model_reads}


def test_effort_and_thinking_go_to_the_template_together() -> None:
    for effort in ("low", "medium", "high", "xhigh", "max"):
        t = translate(_doc(output_config={"effort": effort}))
        assert t.chat["chat_template_kwargs"] == {"reasoning_effort": effort}
    both = translate(
        _doc(
            thinking={"type": "enabled", "budget_tokens": 1024, "display": "summarized"},
            output_config={"effort": "low"},
        )
    )
    assert both.chat["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "low"}
    # Adaptive thinking, whatever its display, sets nothing: the template's default.
    for display in ("omitted", "summarized"):
        t = translate(_doc(thinking={"type": "adaptive", "display": display}))
        assert "chat_template_kwargs" not in t.chat


def test_server_tools_are_left_out_and_reported_deferred_ones_left_out_silently() -> None:
    t = translate(
        _doc(
            tools=[
                WEB_SEARCH,
                WEATHER,
                DEFERRED,
                {"type": "code_execution_20250825", "name": "code_execution"},
                {**WEATHER, "name": "from_code", "allowed_callers": ["code_execution_20250825"]},
                {**WEATHER, "name": "direct", "allowed_callers": ["direct"]},
                {**WEATHER, "name": "ex", "input_examples": [{"city": "Oslo"}]},
                {**WEATHER, "name": "eager", "eager_input_streaming": True},
            ],
            mcp_servers=[{"type": "url", "url": "https://mcp.example", "name": "x"}],
        )
    )
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == [
        "get_weather",
        "direct",
        "ex",
        "eager",
    ]
    assert t.chat["tools"][2]["function"]["parameters"] == WEATHER["input_schema"]
    assert [(path, what) for path, what, _ in t.left_out.items] == [
        ("mcp_servers", "mcp_servers"),
        ("tools.0", "server_tool"),
        ("tools.3", "server_tool"),
        ("tools.4", "code_execution_tool"),
        ("tools.6.input_examples", "tool_input_examples"),
    ]
    assert t.left_out.header() == (
        b"x-areal-left-out",
        b"mcp_servers, tools.0, tools.3, tools.4, tools.6.input_examples",
    )
    # Only server tools: nothing in the prompt, and no tool_choice to send.
    alone = translate(_doc(tools=[WEB_SEARCH], tool_choice={"type": "auto"}))
    assert "tools" not in alone.chat and "tool_choice" not in alone.chat


def _search_result(*content: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation where the model called a tool search, and its result."""
    return [
        {"role": "user", "content": "load the skill tool"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "s1", "name": "search", "input": {"q": "x"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "s1", "content": list(content)}],
        },
    ]


def test_a_tool_search_result_loads_the_deferred_tool_in_place() -> None:
    t = translate(
        _doc(
            tools=[WEATHER, DEFERRED],
            messages=_search_result(
                {"type": "text", "text": "Found:"},
                {"type": "tool_reference", "tool_name": "load_skill"},
                {"type": "tool_reference", "tool_name": "get_weather"},
            ),
        )
    )
    assert t.chat["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "s1",
        "content": "Found:\n<functions>\n"
        '<function>{"description": "Load a skill.", "name": "load_skill", "parameters": '
        '{"type": "object", "properties": {"name": {"type": "string"}}}}</function>\n'
        '<function>{"description": "The weather in a city.", "name": "get_weather", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}</function>\n</functions>',
    }
    # The prompt's tool list stays as it was: the loaded tool is in the result, not there.
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["get_weather"]
    only = translate(
        _doc(
            tools=[WEATHER, DEFERRED],
            messages=_search_result({"type": "tool_reference", "tool_name": "load_skill"}),
        )
    )
    assert only.chat["messages"][-1]["content"].startswith("<functions>\n<function>{")
    _refused(
        _doc(
            tools=[WEATHER, WEB_SEARCH],
            messages=_search_result({"type": "tool_reference", "tool_name": "web_search"}),
        ),
        "messages.2.content.0.content.0.tool_name",
        "names no custom tool",
    )
    _refused(
        _doc(tools=[WEATHER], messages=_search_result({"type": "tool_reference"})),
        "messages.2.content.0.content.0.tool_name",
    )
    _refused(
        _doc(tools=[WEATHER], messages=_search_result({"type": "audio", "data": "x"})),
        "messages.2.content.0.content.0.type",
        "text and tool_reference blocks only",
    )


def test_tool_choice_cannot_force_a_tool_left_out_of_the_prompt() -> None:
    _refused(
        _doc(tools=[WEATHER, DEFERRED], tool_choice={"type": "tool", "name": "load_skill"}),
        "tool_choice.name",
        "deferred",
    )
    _refused(
        _doc(tools=[WEATHER, WEB_SEARCH], tool_choice={"type": "tool", "name": "web_search"}),
        "tool_choice.name",
        "server tools are left out",
    )
    _refused(_doc(tools=[WEB_SEARCH], tool_choice={"type": "any"}), "needs custom 'tools'")
    _refused(_doc(tools=[{**WEATHER, "defer_loading": "yes"}]), "tools.0.defer_loading")
    _refused(_doc(tools=[{**WEATHER, "allowed_callers": "direct"}]), "tools.0.allowed_callers")
    _refused(_doc(tools=[{**WEATHER, "color": "red"}]), "tools.0.color", "not supported")


def test_count_tokens_bodies_need_no_max_tokens_and_never_stream() -> None:
    doc = _doc(stream=True, tools=[WEATHER])
    del doc["max_tokens"]
    t = translate(doc, counting=True)
    assert "max_tokens" not in t.chat and not t.stream and "stream" not in t.chat
    _refused(doc, "max_tokens: Field required")  # /v1/messages still needs it


# --- through the gateway ----------------------------------------------------------------------


def test_claude_code_headers_query_and_keep_all_edit_get_a_200(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    body = {
        "model": "a-text",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Be brief."},
        ],
        "tools": [WEATHER, DEFERRED],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": KEEP_ALL,
        "output_config": {"effort": "high"},
    }
    headers = {
        "x-api-key": ADMIN_KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "context-management-2025-06-27,effort-2025-11-24",
    }
    r = httpx.post(
        stack.url + "/v1/messages?beta=true", content=orjson.dumps(body), headers=headers
    )
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["context_management"] == {"applied_edits": []}
    assert "x-areal-left-out" not in r.headers  # a deferred tool is Anthropic's behaviour
    sent = scripted.bodies[-1]
    assert sent["messages"][-1] == {"role": "system", "content": "Be brief."}
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["chat_template_kwargs"] == {"reasoning_effort": "high"}

    r = httpx.post(
        stack.url + "/v1/messages?beta=true",
        content=orjson.dumps({**body, "stream": True}),
        headers=headers,
    )
    events = _events(r.content)
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["context_management"] == {"applied_edits": []}
    # Without context_management the answer carries no such field.
    plain = _post(stack, {k: v for k, v in body.items() if k != "context_management"}).json()
    assert "context_management" not in plain


def test_the_sdk_beta_client_runs_as_claude_code_does(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    msg = _sdk(stack).beta.messages.create(
        model="a-text",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    )
    assert msg.content[0].text == "Hello there, friend."  # type: ignore[union-attr]
    assert msg.context_management is not None and msg.context_management.applied_edits == []


def test_a_server_tool_is_left_out_and_said_in_the_header_and_the_metric(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    metric = stack.gw.gateway.metrics.left_out.labels("messages", "server_tool")
    before = metric._value.get()
    body = {
        "model": "a-text",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "news?"}],
        "tools": [WEATHER, WEB_SEARCH],
    }
    r = _post(stack, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-areal-left-out"] == "tools.1"
    assert [t["function"]["name"] for t in scripted.bodies[-1]["tools"]] == ["get_weather"]
    r = _post(stack, {**body, "stream": True})
    assert r.status_code == 200 and r.headers["x-areal-left-out"] == "tools.1"
    assert metric._value.get() == before + 2


def test_a_call_to_a_deferred_tool_comes_back_as_tool_use(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    body = {
        "model": "a-deferred",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "make a pdf"}],
        "tools": [WEATHER, DEFERRED],
    }
    msg = _post(stack, body).json()
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [
        {"type": "tool_use", "id": "call_d1", "name": "load_skill", "input": {"name": "pdf"}}
    ]
    # ... and its result goes back as any tool's, failed or not.
    follow = {
        **body,
        "model": "a-text",
        "messages": [
            *body["messages"],
            {"role": "assistant", "content": msg["content"]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_d1",
                        "content": "no such skill",
                        "is_error": True,
                    }
                ],
            },
        ],
    }
    assert _post(stack, follow).status_code == 200
    assert scripted.bodies[-1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_d1",
        "content": "Error: no such skill",
    }


def test_a_template_that_refuses_a_system_message_is_a_clear_400(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    body = {
        "model": "a-template",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "cwd"}],
    }
    for stream in (False, True):
        r = _post(stack, {**body, "stream": stream})
        _assert_error(
            r,
            400,
            "invalid_request_error",
            "System message must be at the beginning.",
            "messages.1 is a system message",
            "send its text in 'system'",
        )
    ok = {**body, "messages": body["messages"][:1], "system": "cwd"}
    assert _post(stack, ok).status_code == 200


# --- POST /v1/messages/count_tokens -------------------------------------------------------------


def _count(stack: Stack, body: Any, key: str = ADMIN_KEY, query: str = "") -> httpx.Response:
    return httpx.post(
        stack.url + "/v1/messages/count_tokens" + query,
        content=orjson.dumps(body),
        headers={"x-api-key": key},
        timeout=10,
    )


def test_count_tokens_asks_a_proxy_of_the_model_with_the_translated_body(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    n_bodies = len(scripted.bodies)
    body = {
        "model": "a-text",
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "cwd"}],
        "tools": [WEATHER, DEFERRED, WEB_SEARCH],
        "thinking": {"type": "adaptive"},
        "context_management": KEEP_ALL,
        "output_config": {"effort": "high"},
    }
    r = _count(stack, body, query="?beta=true")
    assert r.status_code == 200, r.text
    # The scripted proxy's stand-in tokenizer: a token per character, 100 per tool.
    assert r.json() == {"input_tokens": len("Be brief.") + len("hi") + len("cwd") + 100}
    assert r.headers["x-areal-left-out"] == "tools.2"
    sent = scripted.counted[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "cwd"},
    ]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["chat_template_kwargs"] == {"reasoning_effort": "high"}
    assert "max_tokens" not in sent and "stream" not in sent
    assert len(scripted.bodies) == n_bodies  # nothing generated

    tokens = _sdk(stack).messages.count_tokens(
        model="a-text", messages=[{"role": "user", "content": "four"}]
    )
    assert tokens.input_tokens == 4


def test_count_tokens_auth_and_errors_are_anthropic_shaped(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    ok = {"model": "a-text", "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_count(stack, ok, key=""), 401, "authentication_error", "x-api-key")
    _assert_error(_count(stack, ok, key="nope"), 401, "authentication_error")
    _assert_error(_count(stack, {**ok, "model": "no-such"}), 404, "not_found_error", "no-such")
    _assert_error(_count(stack, {"model": "a-text"}), 400, "invalid_request_error", "messages")
    bad_order = {**ok, "messages": [{"role": "assistant", "content": "x"}]}
    _assert_error(_count(stack, bad_order), 400, "invalid_request_error", "prefill")
    refused = {
        **ok,
        "model": "a-template",
        "messages": [*ok["messages"], {"role": "system", "content": "s"}],
    }
    _assert_error(_count(stack, refused), 400, "invalid_request_error", "messages.1 is a system")
    with pytest.raises(anthropic.NotFoundError):
        _sdk(stack).messages.count_tokens(model="no-such", messages=ok["messages"])  # type: ignore[arg-type]


def test_count_tokens_with_a_session_key_reaches_the_proxy_with_it(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    key = stack.gw.gateway.auth.mint_session_key("s-count-1")
    r = _count(
        stack, {"model": "a-text", "messages": [{"role": "user", "content": "abc"}]}, key=key
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": 3}
    env = scripted.envelopes[-1]
    assert env.session_id == "s-count-1" and not env.is_admin and env.api_key == key
