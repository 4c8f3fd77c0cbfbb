"""`POST /v1/responses` on the inference gateway: the translation to a chat body, the chat
answer (whole and streamed) translated back, `previous_response_id` chains, refusals.

The real gateway (conftest's stack) in front of a SCRIPTED proxy (scripted_chat.py) that
answers with a fixed output per model (`_script`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from conftest import ADMIN_KEY, Stack, wait_until
from fakes import serve_models
from scripted_chat import Output, ScriptedProxy, sse_events

from areal_gateway.openai.responses.events import ResponseBuilder
from areal_gateway.openai.responses.items import to_messages
from areal_gateway.openai.responses.request import translate

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}


def _script(model: str, messages: list[dict[str, Any]]) -> Output:
    last = messages[-1]
    if model == "resp-text":
        return Output(content="Hello there, friend.")
    if model == "resp-reason":
        return Output(content="Four.", reasoning="Two and two make four.")
    if model == "resp-length":
        return Output(content="cut sh", finish="length")
    if model == "resp-tool":
        # A tool loop: call the tool, then answer with what it returned.
        if last["role"] == "tool":
            return Output(content=f"The weather: {last['content']}")
        return Output(
            content="Let me check.",
            calls=[("call_w1", "get_weather", '{"city": "Paris"}')],
            finish="tool_calls",
        )
    if model == "resp-two-tools":
        return Output(
            calls=[
                ("call_a", "get_weather", '{"city": "Oslo"}'),
                ("call_b", "get_weather", '{"city": "Rome"}'),
            ],
            finish="tool_calls",
        )
    if model == "resp-echo":  # says how many messages it got and the last one
        return Output(content=f"{len(messages)}:{last.get('content')}")
    raise AssertionError(f"no script for {model}")


MODELS = ("resp-text", "resp-reason", "resp-length", "resp-tool", "resp-two-tools", "resp-echo")


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> ScriptedProxy:
    proxy = ScriptedProxy(_script)
    server = serve_models(stack, proxy, MODELS)
    yield proxy
    stack.bg.run(server.stop(None))


def _client(stack: Stack, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def _post_stream(stack: Stack, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(
        stack.url + "/v1/responses",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# --- the translation, without processes ---------------------------------------------------


def test_every_input_item_kind_becomes_the_chat_conversation() -> None:
    doc = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "thanks"},
        ],
        "max_output_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "metadata": {"k": "v"},
        "user": "u1",
        "store": False,
    }
    t = translate(doc, "m", True)
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "thanks"},
    ]
    assert {k: v for k, v in t.chat.items() if k != "messages"} == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city.",
                    "parameters": WEATHER_TOOL["parameters"],
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}},
        },
        "logprobs": True,
        "top_logprobs": 2,
    }
    assert t.store is False and t.metadata == {"k": "v"} and t.echo["user"] == "u1"
    assert t.echo["tools"][0]["name"] == "get_weather"
    assert t.echo["text"]["format"]["type"] == "json_schema"
    # instructions are not part of what a chain carries on
    assert t.history[0] == {"type": "message", "role": "system", "content": "Use tools."}


def test_a_string_input_json_object_and_a_chain() -> None:
    t = translate(
        {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}, "m", False
    )
    assert t.chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
    }
    history = [
        {"type": "message", "role": "user", "content": "q1"},
        {"type": "message", "role": "assistant", "content": "a1"},
    ]
    seen = []

    def lookup(rid: str) -> list[dict[str, Any]]:
        seen.append(rid)
        return history

    t = translate(
        {"model": "m", "input": "q2", "previous_response_id": "resp_1", "instructions": "I"},
        "m",
        False,
        lookup,
    )
    assert seen == ["resp_1"] and t.previous_response_id == "resp_1"
    assert t.chat["messages"] == [
        {"role": "system", "content": "I"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    # Reasoning alone (no text, no call) still makes an assistant message a template takes.
    assert to_messages([{"type": "reasoning", "text": "r"}]) == [
        {"role": "assistant", "content": "", "reasoning_content": "r"}
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs", "made.up.include"]}, "include[1]"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high", "mode": "deep"}}, "reasoning.mode"),
        ({"text": {"verbosity": "high", "style": "terse"}}, "text.style"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"top_k": 5}, "top_k"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "input[0].encrypted_content",
        ),
    ],
)
def test_what_areal_does_not_honour_is_a_400_naming_it(
    stack: Stack, scripted: ScriptedProxy, extra: dict[str, Any], param: str
) -> None:
    before = len(scripted.bodies)
    body = {"model": "resp-text", "input": "hi", **extra}
    for stream in (False, True):
        r = httpx.post(
            stack.url + "/v1/responses",
            json={**body, "stream": stream},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unsupported_parameter" and err["param"] == param, err
        assert err["type"] == "invalid_request_error" and err["message"]
    assert len(scripted.bodies) == before  # nothing was generated
    with pytest.raises(openai.BadRequestError) as ei:
        _client(stack).responses.create(model="resp-text", input="hi", extra_body=extra)
    assert ei.value.code == "unsupported_parameter"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi"}, 400, "model"),
        ({"model": "resp-text"}, 400, "input"),
        ({"model": "resp-text", "input": 5}, 400, "input"),
        ({"model": "resp-text", "input": []}, 400, "input"),
        (
            {"model": "resp-text", "input": [{"role": "robot", "content": "x"}]},
            400,
            "input[0].role",
        ),
        ({"model": "resp-text", "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"model": "resp-text", "input": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": "resp-text", "input": "hi", "tool_choice": "sometimes"}, 400, "tool_choice"),
        (
            {"model": "resp-text", "input": "hi", "previous_response_id": 7},
            400,
            "previous_response_id",
        ),
        (
            {"model": "resp-text", "input": "hi", "previous_response_id": "resp_nope"},
            404,
            "previous_response_id",
        ),
        ({"model": "no-such-model", "input": "hi"}, 404, "model"),
    ],
)
def test_bad_requests_are_openai_errors(
    stack: Stack, scripted: ScriptedProxy, body: dict[str, Any], status: int, param: str
) -> None:
    r = httpx.post(
        stack.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_only_post(stack: Stack) -> None:
    r = httpx.get(stack.url + "/v1/responses", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.post(stack.url + "/v1/responses", json={"model": "resp-text", "input": "hi"})
    assert r.status_code == 401


# --- whole and streamed answers ------------------------------------------------------------


def test_whole_text_response_with_the_official_sdk(stack: Stack, scripted: ScriptedProxy) -> None:
    r = _client(stack).responses.create(
        model="resp-text",
        input="Say hello.",
        instructions="You are kind.",
        max_output_tokens=16,
        temperature=0.2,
        metadata={"run": "1"},
    )
    sent = scripted.bodies[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Say hello."},
    ]
    assert sent["max_tokens"] == 16 and sent["temperature"] == 0.2 and "stream" not in sent
    # The chat completion's id: the recorded interaction's.
    assert r.id == "resp_" + scripted.ids[-1].removeprefix("chatcmpl-")
    assert r.status == "completed" and r.output_text == "Hello there, friend."
    assert r.instructions == "You are kind." and r.max_output_tokens == 16
    assert r.metadata == {"run": "1"} and r.temperature == 0.2
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (7, 5, 12)


def test_the_alias_path_and_logprobs(stack: Stack, scripted: ScriptedProxy) -> None:
    r = httpx.post(
        stack.url + "/responses",
        json={
            "model": "resp-text",
            "input": "x",
            "include": ["message.output_text.logprobs"],
        },
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert r.status_code == 200, r.text
    assert scripted.bodies[-1]["logprobs"] is True
    [part] = r.json()["output"][0]["content"]
    assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"]


def test_stream_events_in_order_with_the_shapes_of_the_sdk(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    events = _post_stream(stack, {"model": "resp-text", "input": "hi"})
    assert scripted.bodies[-1]["stream"] is True
    assert scripted.bodies[-1]["stream_options"] == {"include_usage": True}
    types = [e["type"] for e in events]
    n = types.count("response.output_text.delta")
    assert n >= 3
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello there, friend."
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["id"] == events[0]["response"]["id"]
    assert done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["output_tokens"] == 5
    assert events[0]["response"]["status"] == "in_progress"
    # The SDK parses every event into its own types.
    with _client(stack).responses.create(model="resp-text", input="hi", stream=True) as stream:
        parsed = list(stream)
    assert [e.type for e in parsed] == types
    assert parsed[-1].response.output_text == text  # type: ignore[union-attr]


def test_the_sdk_stream_helper_and_async_client(stack: Stack, scripted: ScriptedProxy) -> None:
    async def go() -> str:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
        r = await client.responses.create(model="resp-reason", input="2+2?")
        assert [i.type for i in r.output] == ["reasoning", "message"]
        async with client.responses.stream(model="resp-text", input="hi") as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        await client.close()
        return final.output_text

    assert asyncio.run(go()) == "Hello there, friend."


def test_function_call_items_from_a_scripted_tool_call(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    client = _client(stack)
    r = client.responses.create(model="resp-tool", input="Weather in Paris?", tools=[WEATHER_TOOL])  # type: ignore[list-item]
    sent = scripted.bodies[-1]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert [i.type for i in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        "call_w1",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert call.id.startswith("fc_") and call.status == "completed"

    events = _post_stream(stack, {"model": "resp-two-tools", "input": "x", "tools": [WEATHER_TOOL]})
    types = [e["type"] for e in events]
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(c["call_id"], c["arguments"]) for c in calls] == [
        ("call_a", '{"city": "Oslo"}'),
        ("call_b", '{"city": "Rome"}'),
    ]
    for c in calls:
        deltas = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == c["id"]
        ]
        assert len(deltas) > 1 and "".join(deltas) == c["arguments"]
        [done] = [
            e
            for e in events
            if e["type"] == "response.function_call_arguments.done" and e["item_id"] == c["id"]
        ]
        assert done["arguments"] == c["arguments"] and done["name"] == "get_weather"
    # Each call's added < its deltas < its done < the next call's added.
    first_b = types.index("response.output_item.added", types.index("response.output_item.done"))
    assert types[first_b - 2 : first_b] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert "response.content_part.added" not in types  # no text at all
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["function_call"] * 2


def test_reasoning_items_andsse_events(stack: Stack, scripted: ScriptedProxy) -> None:
    events = _post_stream(stack, {"model": "resp-reason", "input": "2+2?"})
    types = [e["type"] for e in events]
    assert types[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "Two and two make four."
    [done] = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == reasoning
    out = events[-1]["response"]["output"]
    assert out[0]["type"] == "reasoning"
    assert out[0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert out[1]["content"][0]["text"] == "Four."
    # Passed back as input, the reasoning goes to the chat template with its answer.
    _client(stack).responses.create(
        model="resp-echo", input=[*out, {"role": "user", "content": "ok"}]
    )  # type: ignore[list-item]
    assert scripted.bodies[-1]["messages"][0] == {
        "role": "assistant",
        "content": "Four.",
        "reasoning_content": reasoning,
    }


def test_a_length_stop_is_an_incomplete_response(stack: Stack, scripted: ScriptedProxy) -> None:
    r = _client(stack).responses.create(model="resp-length", input="x", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    events = _post_stream(stack, {"model": "resp-length", "input": "x"})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# --- previous_response_id -------------------------------------------------------------------


def test_previous_response_id_chains_a_tool_loop(stack: Stack, scripted: ScriptedProxy) -> None:
    client = _client(stack)
    first = client.responses.create(
        model="resp-tool",
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
        instructions="A",  # type: ignore[list-item]
    )
    call = first.output[1]
    assert call.type == "function_call"
    second = client.responses.create(
        model="resp-tool",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        instructions="B",
    )
    assert second.previous_response_id == first.id
    assert second.output_text == "The weather: sunny"
    assert scripted.bodies[-1]["messages"] == [
        {"role": "system", "content": "B"},  # only the new instructions
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_w1", "content": "sunny"},
    ]
    # A third turn, streamed, continues the second (whose conversation holds the first).
    events = _post_stream(
        stack, {"model": "resp-echo", "input": "and now?", "previous_response_id": second.id}
    )
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "5:and now?"
    assert len(scripted.bodies[-1]["messages"]) == 5
    # ... and a stream's response is stored too.
    r = client.responses.create(model="resp-echo", input="more", previous_response_id=final["id"])
    assert r.output_text == "7:more"


def test_store_false_and_other_keys_cannot_continue(stack: Stack, scripted: ScriptedProxy) -> None:
    client = _client(stack)
    unstored = client.responses.create(model="resp-text", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="resp-text", input="hi", previous_response_id=unstored.id)
    assert ei.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert ei.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    stored = client.responses.create(model="resp-text", input="hi")
    stack.gw.gateway.auth.add_session_key("sess-key-responses-a", "s-resp-a")
    stack.gw.gateway.auth.add_session_key("sess-key-responses-b", "s-resp-b")
    a, b = _client(stack, "sess-key-responses-a"), _client(stack, "sess-key-responses-b")
    with pytest.raises(openai.NotFoundError):  # the admin's, not a session's
        a.responses.create(model="resp-text", input="hi", previous_response_id=stored.id)
    mine = a.responses.create(model="resp-text", input="hi")
    assert (
        a.responses.create(model="resp-echo", input="x", previous_response_id=mine.id).output_text
        == "3:x"
    )
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model="resp-text", input="hi", previous_response_id=mine.id)


def test_get_and_delete_a_stored_response(stack: Stack, scripted: ScriptedProxy) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(
        stack.url + "/v1/responses", json={"model": "resp-length", "input": "hi"}, headers=admin
    )
    posted = r.json()
    assert posted["status"] == "incomplete"
    got = httpx.get(stack.url + f"/v1/responses/{posted['id']}", headers=admin)
    assert got.status_code == 200 and got.content == r.content  # the bytes the POST answered
    # A streamed one: the last event's response; through the SDK and the alias path.
    events = _post_stream(stack, {"model": "resp-reason", "input": "2+2?"})
    final = events[-1]["response"]
    sdk = _client(stack).responses.retrieve(final["id"])
    assert sdk.id == final["id"] and sdk.output_text == "Four." and sdk.status == "completed"
    assert [item.type for item in sdk.output] == ["reasoning", "message"]
    alias = httpx.get(stack.url + f"/responses/{final['id']}", headers=admin)
    assert alias.json() == final
    # Ownership: another key (a session's) gets the same 404 as an unknown id.
    stack.gw.gateway.auth.add_session_key("sess-key-responses-get", "s-resp-get")
    session = {"Authorization": "Bearer sess-key-responses-get"}
    for headers, rid in ((session, final["id"]), (admin, "resp_unknown")):
        for method in ("GET", "DELETE"):
            r = httpx.request(method, stack.url + f"/v1/responses/{rid}", headers=headers)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["code"] == "response_not_found" and err["param"] == "response_id"
    assert httpx.get(stack.url + f"/v1/responses/{final['id']}").status_code == 401
    # The session's own.
    mine = _client(stack, "sess-key-responses-get").responses.create(model="resp-text", input="x")
    assert _client(stack, "sess-key-responses-get").responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        _client(stack).responses.retrieve(mine.id)
    # DELETE answers OpenAI's shape; then it is gone, for GET and for continuing.
    d = httpx.delete(stack.url + f"/v1/responses/{final['id']}", headers=admin)
    assert d.status_code == 200
    assert d.json() == {"id": final["id"], "object": "response", "deleted": True}
    assert httpx.get(stack.url + f"/v1/responses/{final['id']}", headers=admin).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _client(stack).responses.create(
            model="resp-text", input="more", previous_response_id=final["id"]
        )
    assert _client(stack).responses.delete(posted["id"]) is None  # the SDK's delete
    # Not stored: never readable.
    unstored = _client(stack).responses.create(model="resp-text", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        _client(stack).responses.retrieve(unstored.id)


def test_gateways_sharing_a_response_store_file(
    stack: Stack, scripted: ScriptedProxy, tmp_path: Any
) -> None:
    """Two gateways of one service on one --response-store: a chain goes on through either,
    and survives a gateway that is gone."""
    path = str(tmp_path / "responses.db")
    a = stack.start_gateway(response_store=path)
    b = stack.start_gateway(response_store=path)
    ca = openai.OpenAI(base_url=a.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    cb = openai.OpenAI(base_url=b.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    first = ca.responses.create(model="resp-echo", input="one")
    second = cb.responses.create(model="resp-echo", input="two", previous_response_id=first.id)
    assert second.output_text == "3:two"  # user, assistant, user: the chain came from a's turn
    third = ca.responses.create(model="resp-echo", input="three", previous_response_id=second.id)
    assert third.output_text == "5:three"
    assert cb.responses.retrieve(third.id).output_text == "5:three"
    # b stops (its store closes); a gateway started anew on the file finds the chain.
    b.server.should_exit = True
    stack.bg.run(asyncio.wait_for(b.task, 10))
    c = stack.start_gateway(response_store=path)
    cc = openai.OpenAI(base_url=c.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    fourth = cc.responses.create(model="resp-echo", input="four", previous_response_id=third.id)
    assert fourth.output_text == "7:four"
    cc.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        ca.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as ei:  # its chain lost a turn
        ca.responses.create(model="resp-echo", input="five", previous_response_id=fourth.id)
    assert ei.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert ca.responses.retrieve(fourth.id).output_text == "7:four"


# --- failures and disconnects --------------------------------------------------------------


def test_a_client_that_goes_away_cancels_the_generation(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST",
            stack.url + "/v1/responses",
            json={"model": "resp-text", "input": "hang", "stream": True},
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "x-request-id": "resp-gone-1"},
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    assert wait_until(lambda: "resp-gone-1" in scripted.cancelled)


def test_a_failure_after_the_headers_is_an_error_event_then_failed() -> None:
    b = ResponseBuilder("resp_1", "m")
    raw = b.start() + b.text("par") + b.fail("engine_error", "engine died", None)
    events = sse_events(raw)
    assert [e["type"] for e in events][-4:] == [
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert events[-1]["response"]["error"] == {"code": "engine_error", "message": "engine died"}


# --- openai-agents' default Runner (its Responses model) -------------------------------------


def test_openai_agents_default_runner_completes_a_tool_loop(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    import agents  # the gateway's dev group installs it: this test never skips

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def go() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the tool.",
            model="resp-tool",
            tools=[get_weather],
        )
        result = await agents.Runner.run(agent, "Weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return str(result.final_output), str(streamed.final_output)

    whole, streamed = asyncio.run(go())
    assert whole == streamed == "The weather: sunny in Paris"
    assert calls == ["Paris", "Paris"]
    # The second model call of a run carried the call and its output back as chat messages.
    assert [m["role"] for m in scripted.bodies[-1]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]
