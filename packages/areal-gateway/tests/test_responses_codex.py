"""`POST /v1/responses` as Codex CLI uses it (0.171, default config, a model it does not know,
`store: false`): what it sends is accepted, or left out and reported; its namespace and
custom tools reach the model as chat functions, and the model's calls come back as the
items Codex dispatches (a `function_call` with `namespace`, a `custom_tool_call`); reasoning
carries summary parts and `encrypted_content: null`; and the whole conversation Codex
resends each turn renders the assistant message the model produced, byte for byte.

The request shapes are minimal ones of our own, with the fields and item kinds Codex sends.
The real gateway (conftest's stack) in front of a SCRIPTED proxy (scripted_chat.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from conftest import ADMIN_KEY, Stack
from fakes import serve_models
from scripted_chat import Output, ScriptedProxy, sse_events

from areal_gateway.left_out import HEADER
from areal_gateway.openai.responses.request import translate
from areal_runtime.errors import InvalidRequest

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
SPAWN = {
    "type": "function",
    "name": "spawn",
    "description": "Start a sub-agent.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
}
# A namespace whose second tool has the name of a top-level one.
AGENTS = {
    "type": "namespace",
    "name": "agents_ns",
    "description": "Sub-agents.",
    "tools": [SPAWN, {**EXEC, "description": "Run a command in a sub-agent."}],
}
GRAMMAR = 'start: "BEGIN" /(.|\\n)*/ "END"'
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
WEB = {"type": "web_search", "external_web_access": False}
TOOLS = [EXEC, AGENTS, PATCH, WEB]
INSTRUCTIONS = {
    "type": "message",
    "id": "msg_dev",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a coding agent."}],
}


def _say(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_body(input_items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A body with the top-level fields Codex sends on every turn."""
    return {
        "model": "codex-call",
        "stream": True,
        "input": input_items,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"thread_id": "thread-1", "turn_id": "turn-1"},
        **extra,
    }


def _script(model: str, messages: list[dict[str, Any]]) -> Output:
    last = messages[-1]
    if last["role"] == "tool":
        return Output(content=f"done: {last['content']}")
    # "call <chat function> <arguments>": the model calls it, after a thought.
    _, name, args = last["content"].split(" ", 2)
    return Output(reasoning="I will call it.", calls=[("call_1", name, args)], finish="tool_calls")


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> ScriptedProxy:
    proxy = ScriptedProxy(_script)
    server = serve_models(stack, proxy, ("codex-call",))
    yield proxy
    stack.bg.run(server.stop(None))


def _post(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(
        stack.url + "/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r


def _turn(stack: Stack, body: dict[str, Any]) -> tuple[list[dict[str, Any]], httpx.Response]:
    """A streamed turn: the items Codex keeps (each `response.output_item.done`'s item)."""
    r = _post(stack, body)
    events = sse_events(r.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert items == events[-1]["response"]["output"]
    return items, r


def _resent(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as Codex sends it back: without `id` (and a call without `status`)."""
    return {
        k: v for k, v in item.items() if k != "id" and not (k == "status" and "call_id" in item)
    }


# --- the translation, without processes ---------------------------------------------------


def test_codex_tools_become_chat_functions_with_names_that_do_not_collide() -> None:
    t = translate(codex_body([INSTRUCTIONS, _say("hi")]), "m", True)
    chat_tools = {tool["function"]["name"]: tool["function"] for tool in t.chat["tools"]}
    # A namespaced tool keeps its name when it is unique, else is prefixed by its namespace.
    assert list(chat_tools) == ["exec_command", "spawn", "agents_ns__exec_command", "apply_patch"]
    assert chat_tools["exec_command"]["description"] == "Run a shell command."
    assert chat_tools["agents_ns__exec_command"]["description"] == "Run a command in a sub-agent."
    assert chat_tools["spawn"]["parameters"] == SPAWN["parameters"]
    # The custom tool: one string argument, its grammar in that argument's description.
    patch = chat_tools["apply_patch"]
    assert patch["description"] == "Edit files with a patch."
    assert patch["parameters"]["required"] == ["input"]
    assert GRAMMAR in patch["parameters"]["properties"]["input"]["description"]
    assert t.tools.ref("agents_ns__exec_command").namespace == "agents_ns"
    assert t.tools.ref("apply_patch").custom and t.tools.ref("spawn").name == "spawn"
    # The hosted tool is not in the prompt; it and the unenforced grammar are reported.
    assert [(p, what) for p, what, _ in t.left_out.items] == [
        ("tools[2].format", "custom_tool_grammar"),
        ("tools[3]", "tool.web_search"),
    ]
    assert t.chat["chat_template_kwargs"] == {"reasoning_effort": "medium"}
    assert t.chat["tool_choice"] == "auto" and t.chat["parallel_tool_calls"] is True
    assert t.summary and t.encrypted_content and t.store is False
    assert t.echo["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert [tool["type"] for tool in t.echo["tools"]] == ["function", "namespace", "custom"]
    assert t.chat["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "hi"},
    ]


def test_a_forced_namespaced_or_custom_tool_is_its_chat_function() -> None:
    for choice, name in (
        (
            {"type": "function", "name": "exec_command", "namespace": "agents_ns"},
            "agents_ns__exec_command",
        ),
        ({"type": "function", "name": "spawn", "namespace": "agents_ns"}, "spawn"),
        ({"type": "custom", "name": "apply_patch"}, "apply_patch"),
    ):
        t = translate(codex_body([_say("hi")], tool_choice=choice), "m", False)
        assert t.chat["tool_choice"] == {"type": "function", "function": {"name": name}}
    # Only hosted tools, `auto`: no tools and no choice for the chat template.
    t = translate(codex_body([_say("hi")], tools=[WEB]), "m", False)
    assert "tools" not in t.chat and "tool_choice" not in t.chat


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        # a top-level name twice
        ([EXEC, EXEC], "tools[1].name"),
        # still taken once prefixed: a top-level `x`, a top-level `ns__x`, and `x` in `ns`
        (
            [
                {**EXEC, "name": "x"},
                {**EXEC, "name": "ns__x"},
                {"type": "namespace", "name": "ns", "tools": [{**EXEC, "name": "x"}]},
            ],
            "tools[2].tools[0].name",
        ),
        ([{"type": "namespace", "name": "ns", "tools": "x"}], "tools[0].tools"),
        ([{"type": "custom", "name": "p", "format": {"type": "regex"}}], "tools[0].format.type"),
        ([{"type": 7}], "tools[0].type"),
    ],
)
def test_tools_that_cannot_be_named_apart_are_a_400(tools: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as ei:
        translate(codex_body([_say("hi")], tools=tools), "m", False)
    assert ei.value.param == param, ei.value.message


def test_reasoning_settings_and_includes() -> None:
    def t_of(**extra: Any) -> Any:
        return translate({"model": "m", "input": "hi", **extra}, "m", False)

    plain = t_of()
    assert not plain.summary and not plain.encrypted_content and not plain.left_out
    assert "chat_template_kwargs" not in plain.chat
    assert t_of(reasoning={"effort": "none"}).chat["chat_template_kwargs"] == {
        "reasoning_effort": "none"
    }
    assert t_of(reasoning={"generate_summary": "concise"}).summary
    assert t_of(reasoning={"summary": None, "effort": None}).summary is False
    for bad, param, code in (
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary", "invalid_value"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity", "invalid_value"),
        ({"client_metadata": "x"}, "client_metadata", "invalid_type"),
    ):
        with pytest.raises(InvalidRequest) as ei:
            t_of(**bad)
        assert (ei.value.param, ei.value.code) == (param, code)
    # What changes nothing areal samples is left out, in the order it came.
    t = t_of(
        service_tier="priority",
        text={"verbosity": "low"},
        include=["web_search_call.action.sources", "reasoning.encrypted_content"],
    )
    assert [p for p, _, _ in t.left_out.items] == ["text.verbosity", "include[0]", "service_tier"]
    assert t.encrypted_content and t.echo["text"] == {
        "format": {"type": "text"},
        "verbosity": "low",
    }


# --- over HTTP ------------------------------------------------------------------------------


def test_first_turn_a_namespaced_call_with_summary_and_encrypted_slot(
    stack: Stack, scripted: ScriptedProxy, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = stack.gw.gateway.metrics.registry

    def web_count() -> float:
        labels = {"api": "responses", "what": "tool.web_search"}
        return metrics.get_sample_value("areal_gateway_left_out_total", labels) or 0.0

    before = web_count()
    args = '{"task": "list files"}'
    with caplog.at_level(logging.INFO, logger="areal_gateway.left_out"):
        items, r = _turn(stack, codex_body([INSTRUCTIONS, _say(f"call spawn {args}")]))
    assert r.headers[HEADER.decode()] == "tools[2].format, tools[3]"
    assert web_count() == before + 1
    assert "tools[3] (tool type 'web_search'" in caplog.text
    sent = scripted.bodies[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "exec_command",
        "spawn",
        "agents_ns__exec_command",
        "apply_patch",
    ]
    assert sent["chat_template_kwargs"] == {"reasoning_effort": "medium"}
    assert "client_metadata" not in sent and "prompt_cache_key" not in sent
    reasoning, call = items
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"] is None
    assert reasoning["summary"] == [{"type": "summary_text", "text": "I will call it."}]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I will call it."}]
    # How Codex dispatches a namespaced tool: its inner name and its namespace.
    assert {k: call[k] for k in ("type", "name", "namespace", "call_id", "arguments")} == {
        "type": "function_call",
        "name": "spawn",
        "namespace": "agents_ns",
        "call_id": "call_1",
        "arguments": args,
    }
    # The summary is streamed as OpenAI streams one (Codex shows its deltas).
    events = sse_events(r.content)
    types = [e["type"] for e in events]
    for kind in (
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ):
        assert kind in types
    summary = [e for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    assert "".join(e["delta"] for e in summary) == "I will call it."
    assert all(e["summary_index"] == 0 for e in summary)
    # Whole, the same items; the header too.
    whole = _post(stack, codex_body([_say(f"call spawn {args}")], stream=False))
    assert whole.headers[HEADER.decode()] == "tools[2].format, tools[3]"
    assert [i["type"] for i in whole.json()["output"]] == ["reasoning", "function_call"]
    assert whole.json()["output"][1]["namespace"] == "agents_ns"


def test_without_summary_or_include_reasoning_has_neither(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    body = {"model": "codex-call", "input": 'call exec_command {"cmd": "ls"}', "tools": [EXEC]}
    r = _post(stack, body)
    assert HEADER.decode() not in r.headers
    reasoning, call = r.json()["output"]
    assert reasoning["summary"] == [] and "encrypted_content" not in reasoning
    assert call["name"] == "exec_command" and "namespace" not in call
    events = sse_events(_post(stack, {**body, "stream": True}).content)
    assert not [e for e in events if "summary" in e["type"]]


def test_a_custom_tool_call_and_its_input_events(stack: Stack, scripted: ScriptedProxy) -> None:
    patch = "BEGIN\nadd a line\nEND"
    args = json.dumps({"input": patch})
    items, r = _turn(stack, codex_body([_say(f"call apply_patch {args}")]))
    call = items[1]
    assert {k: call[k] for k in ("type", "name", "call_id", "input")} == {
        "type": "custom_tool_call",
        "name": "apply_patch",
        "call_id": "call_1",
        "input": patch,
    }
    assert "arguments" not in call and "namespace" not in call
    events = sse_events(r.content)
    [added] = [
        e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == 1
    ]
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""
    deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert "".join(e["delta"] for e in deltas) == done["input"] == patch
    assert not [e for e in events if e["type"].startswith("response.function_call_arguments")]
    # Arguments that hold no string `input`: the raw arguments are the input.
    items, _ = _turn(stack, codex_body([_say("call apply_patch not json")]))
    assert items[1]["input"] == "not json"


@pytest.mark.parametrize(
    ("chat_name", "args"),
    [
        ("agents_ns__exec_command", '{"cmd": "pwd"}'),  # namespaced, prefixed
        ("exec_command", '{"cmd":"ls -la"}'),  # top-level, compact JSON kept as it is
        ("apply_patch", json.dumps({"input": "BEGIN\nx\nEND"})),  # custom
    ],
)
def test_the_conversation_codex_resends_is_what_the_model_produced(
    stack: Stack, scripted: ScriptedProxy, chat_name: str, args: str
) -> None:
    """`store: false`: Codex resends the whole conversation, with the items it kept; the
    proxy must see the assistant message it produced, to continue the sampled ids."""
    first = [INSTRUCTIONS, _say(f"call {chat_name} {args}")]
    items, _ = _turn(stack, codex_body(first))
    produced = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I will call it.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": chat_name, "arguments": args}}
        ],
    }
    output_kind = (
        "custom_tool_call_output"
        if items[1]["type"] == "custom_tool_call"
        else ("function_call_output")
    )
    second = [
        *first,
        *(_resent(i) for i in items),
        {"type": output_kind, "call_id": "call_1", "output": "ok"},
    ]
    items2, _ = _turn(stack, codex_body(second))
    messages = scripted.bodies[-1]["messages"]
    assert messages[2] == produced
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    assert items2[0]["content"][0]["text"] == "done: ok"
    # Reasoning handed back with only its summary (no content) is the same reasoning.
    reasoning = {**_resent(items[0])}
    del reasoning["content"]
    _turn(stack, codex_body([*first, reasoning, *(_resent(i) for i in items[1:]), second[-1]]))
    assert scripted.bodies[-1]["messages"][2] == produced


def test_a_chain_keeps_a_custom_call_exactly_as_the_model_wrote_it(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    """With `previous_response_id` the stored turn holds the chat call as produced: compact
    JSON a model wrote stays compact (handed back by a client, it is re-serialized)."""
    args = '{"input":"BEGIN\\nx\\nEND"}'
    body = codex_body([_say(f"call apply_patch {args}")], store=True, stream=False)
    first = _post(stack, body).json()
    assert first["output"][1]["input"] == "BEGIN\nx\nEND"
    out = {"type": "custom_tool_call_output", "call_id": "call_1", "output": "applied"}
    _post(stack, {**body, "input": [out], "previous_response_id": first["id"]})
    call = scripted.bodies[-1]["messages"][1]["tool_calls"][0]
    assert call["function"] == {"name": "apply_patch", "arguments": args}
