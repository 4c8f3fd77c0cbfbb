"""`POST /v1/messages` on the inference gateway: the Messages body translated to a chat body,
the chat answer (whole and streamed) translated back to a Message and Anthropic's events,
tools and tool_choice, stop sequences, errors in Anthropic's shape, and the key in `x-api-key`.

The real gateway (conftest's stack) in front of a SCRIPTED proxy (here): it answers the chat
body it gets with a fixed output per model, streamed as the real proxy streams it (role chunk,
reasoning / content / tool-call deltas, finish chunk, usage chunk), with logprobs when asked;
it keeps every chat body. Clients: the official `anthropic` SDK, and raw HTTP where the
wire itself is the point.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, MAX_BODY, Stack
from fakes import serve_models
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_gateway.anthropic.request import translate
from areal_gateway.anthropic.response import matched_stop
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.errors import InvalidRequest, NoHealthyReplica, Overloaded, abort

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
USAGE = {"prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22}


@dataclass
class Output:
    content: str | None = None
    reasoning: str | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    finish: str = "stop"
    # What the model generated (its tokens' text) when the answer was cut at a stop string.
    generated: str | None = None


def _script(model: str, doc: dict[str, Any]) -> Output:
    last = doc["messages"][-1]
    if model in ("a-text", "a-template"):
        return Output(content="Hello there, friend.")
    if model == "a-reason":
        return Output(content="Four.", reasoning="Two and two make four.")
    if model == "a-length":
        return Output(content="cut sh", finish="length")
    if model == "a-tool":
        if last["role"] == "tool":
            return Output(content=f"The weather: {last['content']}")
        return Output(
            content="Let me check.",
            calls=[("call_w1", "get_weather", '{"city": "Paris"}')],
            finish="tool_calls",
        )
    if model == "a-deferred":
        # A call to a tool the request deferred (defer_loading): not in the prompt's tools.
        return Output(calls=[("call_d1", "load_skill", '{"name": "pdf"}')], finish="tool_calls")
    if model == "a-stop":
        # As the proxy does: the text ends before the first stop string; the tokens do not.
        generated = "one two STOP three END four"
        cut = min((generated.find(s) for s in doc.get("stop", []) if s in generated), default=-1)
        text = generated[:cut] if cut >= 0 else generated
        return Output(content=text, generated=generated)
    raise AssertionError(f"no script for {model}")


def _pieces(text: str, n: int = 3) -> list[str]:
    step = max(1, len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]


def _logprobs(text: str) -> dict[str, Any]:
    return {
        "content": [
            {"token": p, "logprob": -0.5, "bytes": list(p.encode()), "top_logprobs": []}
            for p in _pieces(text)
        ]
    }


class ScriptedProxy(
    proxy_pb2_grpc.InferenceProxyServiceServicer, proxy_pb2_grpc.ProxyStatusServiceServicer
):
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.envelopes: list[Any] = []
        self.cancelled: list[str] = []
        self.counted: list[dict[str, Any]] = []  # CountTokens bodies

    async def _template_refuses(self, request: Any, context: Any) -> None:
        """Model `a-template` has a chat template that refuses a system message after the
        first, as the real proxy answers it (chat_template_error)."""
        if request.envelope.model != "a-template":
            return
        doc = orjson.loads(request.body)
        if any(m["role"] == "system" for m in doc["messages"][1:]):
            await abort(
                context,
                InvalidRequest(
                    "System message must be at the beginning.",
                    code="chat_template_error",
                    param="messages",
                ),
            )

    async def CountTokens(self, request: Any, context: Any) -> Any:
        await self._template_refuses(request, context)
        doc = orjson.loads(request.body)
        self.counted.append(doc)
        self.envelopes.append(request.envelope)
        # A stand-in for the tokenizer: one token per character of text, 100 per tool.
        n = sum(len(m.get("content") or "") for m in doc["messages"])
        return proxy_pb2.CountTokensResponse(input_tokens=n + 100 * len(doc.get("tools") or []))

    def _take(self, request: Any) -> tuple[dict[str, Any], Output]:
        doc = orjson.loads(request.body)
        self.bodies.append(doc)
        self.envelopes.append(request.envelope)
        return doc, _script(request.envelope.model, doc)

    async def GetStats(self, request: Any, context: Any) -> Any:
        return proxy_pb2.ProxyStats(healthy=True, detail="SCRIPTED proxy")

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        if request.envelope.model == "a-busy":
            await abort(context, NoHealthyReplica("every replica is busy"))
        if request.envelope.model == "a-limited":
            await abort(context, Overloaded("too many requests in flight"))
        await self._template_refuses(request, context)
        doc, out = self._take(request)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in out.calls
            ]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": out.finish}
        if doc.get("logprobs"):
            choice["logprobs"] = _logprobs(out.generated or out.content or "")
        body = {
            "id": f"chatcmpl-{len(self.bodies):024x}",
            "object": "chat.completion",
            "created": 1,
            "model": request.envelope.model,
            "choices": [choice],
            "usage": USAGE,
        }
        return envelope_pb2.OpenAIResponse(body=orjson.dumps(body))

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        await self._template_refuses(request, context)
        doc, out = self._take(request)
        rid = request.envelope.request_id
        cid = f"chatcmpl-{len(self.bodies):024x}"

        def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> Any:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            c = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 1,
                "model": request.envelope.model,
                "choices": [choice],
                "usage": None,
            }
            return envelope_pb2.StreamChunk(data=orjson.dumps(c))

        try:
            yield chunk({"role": "assistant", "content": ""})
            for p in _pieces(out.reasoning or ""):
                yield chunk({"reasoning_content": p})
            if doc["messages"][-1].get("content") == "fail midway":
                yield chunk({"content": "partial"})
                await abort(context, InvalidRequest("the engine refused the rest"))
            text = out.content or ""
            if out.generated is not None and doc.get("logprobs"):
                # The stop string's tokens come with the last piece of visible text.
                yield chunk({"content": text}, lp=_logprobs(out.generated))
            else:
                for p in _pieces(text):
                    yield chunk({"content": p})
            for k, (i, n, a) in enumerate(out.calls):
                yield chunk(
                    {
                        "tool_calls": [
                            {"index": k, "id": i, "type": "function", "function": {"name": n}}
                        ]
                    }
                )
                for p in _pieces(a):
                    yield chunk({"tool_calls": [{"index": k, "function": {"arguments": p}}]})
            yield chunk({}, out.finish)
            yield envelope_pb2.StreamChunk(
                data=orjson.dumps({"id": cid, "choices": [], "usage": USAGE})
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


MODELS = (
    "a-text",
    "a-reason",
    "a-length",
    "a-tool",
    "a-stop",
    "a-busy",
    "a-limited",
    "a-deferred",
    "a-template",
)


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> Any:
    proxy = ScriptedProxy()
    server = serve_models(stack, proxy, MODELS)
    yield proxy
    stack.bg.run(server.stop(None))


def _sdk(stack: Stack, key: str = ADMIN_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0)


def _post(stack: Stack, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        stack.url + "/v1/messages",
        content=body if isinstance(body, bytes) else orjson.dumps(body),
        headers={"x-api-key": ADMIN_KEY} if headers is None else headers,
        timeout=10,
    )


def _events(raw: bytes) -> list[dict[str, Any]]:
    """Anthropic's SSE: `event: <type>` then `data: <json>` whose `type` is the same."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.splitlines()
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = orjson.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: ")
        out.append(data)
    return out


def _assert_error(r: httpx.Response, status: int, kind: str, *words: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind, body
    message = body["error"]["message"]
    assert "Traceback" not in message
    for w in words:
        assert w in message, message
    return message


# --- the translation, without processes ---------------------------------------------------


def test_a_whole_conversation_becomes_the_chat_conversation() -> None:
    doc = {
        "model": "m",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two calls.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "c1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "c2",
                        "name": "get_weather",
                        "input": {"city": "Rôme"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "c2",
                        "content": [{"type": "text", "text": "rain"}],
                        "is_error": False,
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "u1"},
        "stream": True,
    }
    t = translate(doc)
    assert t.model == "m" and t.stream and t.stop_sequences == ["END"]
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                # As the proxy's tool parsers write arguments (json.dumps, unicode as is).
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rôme"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert {k: v for k, v in t.chat.items() if k != "messages"} == {
        "model": "m",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
        "logprobs": True,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": WEATHER["input_schema"],
                    "description": "The weather in a city.",
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": True},
    }


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_tool_choice_maps_onto_the_openai_equivalents(choice: dict, chat: Any) -> None:
    doc = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER],
        "tool_choice": choice,
    }
    body = translate(doc).chat
    assert body["tool_choice"] == chat
    assert "parallel_tool_calls" not in body  # parallel unless disabled


def test_other_fields_map_as_documented() -> None:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    plain = translate(base).chat
    assert plain == {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert translate({**base, "system": "S"}).chat["messages"][0] == {
        "role": "system",
        "content": "S",
    }
    off = translate({**base, "thinking": {"type": "disabled"}}).chat
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in translate({**base, "thinking": {"type": "adaptive"}}).chat
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = translate(
        {**base, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert fmt.chat["response_format"]["json_schema"]["schema"] == schema
    # Informational fields change nothing.
    info = {**base, "service_tier": "auto", "cache_control": {"type": "ephemeral"}, "metadata": {}}
    assert translate(info).chat == plain


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"max_tokens": None}, ["max_tokens: Field required"]),
        ({"max_tokens": 0}, ["max_tokens: must be at least 1"]),
        ({"model": None}, ["model"]),
        ({"messages": []}, ["messages: must be a non-empty array"]),
        ({"temperature": 1.5}, ["temperature: must be between 0 and 1"]),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, ["stop_sequences", "at most 4"]),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Sure"},
                ]
            },
            ["messages.1.role", "prefill"],
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            ["messages.0.role", "'user', 'assistant' or 'system'"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]},
            ["messages.0.content.0.type", "unknown content block type 'video'"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            ["messages.0.content.0.type", "'image'", "text only"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            ["'document'", "text only"],
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}],
                    }
                ]
            },
            ["messages.0.content.0.tool_use_id", "answers no tool_use"],
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Sure"},
                    {"role": "system", "content": "Be brief."},
                ]
            },
            ["messages.1.role", "other than system messages", "prefill"],
        ),
        (
            {"messages": [{"role": "system", "content": "Be brief."}]},
            ["messages: needs a user message"],
        ),
        ({"tools": [{"name": "f"}]}, ["tools.0.input_schema"]),
        ({"tool_choice": {"type": "any"}}, ["tool_choice", "needs custom 'tools'"]),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            ["no tool named 'nope'"],
        ),
        ({"diagnostics": {"x": 1}}, ["diagnostics", "not supported"]),
        ({"frequency_penalty": 1}, ["frequency_penalty", "Extra inputs are not permitted"]),
        ({"output_config": {"effort": "extreme"}}, ["output_config.effort", "max"]),
        ({"output_config": {"task_budget": 5}}, ["output_config.task_budget"]),
        ({"thinking": {"type": "adaptive", "display": 1}}, ["thinking.display"]),
    ],
)
def test_bad_or_unhonoured_input_is_a_clear_400(patch: dict, words: list[str]) -> None:
    doc: dict[str, Any] = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    for k, v in patch.items():
        if v is None:
            doc.pop(k)
        else:
            doc[k] = v
    with pytest.raises(InvalidRequest) as ei:
        translate(doc)
    assert ei.value.http_status == 400
    for w in words:
        assert w in ei.value.message, ei.value.message


def test_the_first_stop_sequence_in_the_generated_tokens_is_the_one_that_stopped() -> None:
    assert matched_stop(b"one two STOP three END", ["END", "STOP"]) == "STOP"
    assert matched_stop(b"abcd", ["bc", "b"]) == "bc"  # same place: the first listed
    assert matched_stop(b"no hit here", ["END"]) is None


# --- through the gateway, with the official SDK ---------------------------------------------


def test_text_with_the_sdk_and_its_key_in_x_api_key(stack: Stack, scripted: ScriptedProxy) -> None:
    client = _sdk(stack)
    m = client.messages.create(
        model="a-text",
        max_tokens=32,
        system="Be kind.",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": "Again"}]},
        ],
        # Sampling fields are the body's; the SDK (2.x) no longer has arguments for them.
        extra_body={"temperature": 0.2, "top_p": 0.8, "top_k": 5},
    )
    assert m.type == "message" and m.role == "assistant" and m.model == "a-text"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "Hello there, friend."  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == 17 and m.usage.output_tokens == 5
    # The message id is the chat completion's: a recorded interaction's id names it.
    assert m.id == f"msg_{len(scripted.bodies):024x}"
    body = scripted.bodies[-1]
    assert body["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (
        32,
        0.2,
        0.8,
        5,
    )
    assert scripted.envelopes[-1].is_admin


def test_a_bearer_token_works_too_and_a_session_key_reaches_the_proxy(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    client = anthropic.Anthropic(base_url=stack.url, auth_token=ADMIN_KEY, max_retries=0)
    assert client.messages.create(
        model="a-text", max_tokens=4, messages=[{"role": "user", "content": "x"}]
    ).content
    key = stack.gw.gateway.auth.mint_session_key("s-anthropic-1")
    m = _sdk(stack, key).messages.create(
        model="a-text", max_tokens=4, messages=[{"role": "user", "content": "x"}]
    )
    assert m.stop_reason == "end_turn"
    env = scripted.envelopes[-1]
    assert env.session_id == "s-anthropic-1" and not env.is_admin and env.api_key == key


def test_the_call_header_reaches_the_proxy_and_a_bad_one_is_refused_anthropic_style(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    body = {"model": "a-text", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = _post(stack, body, headers={"x-api-key": ADMIN_KEY, "x-areal-call": "side"})
    assert r.status_code == 200, r.text
    assert scripted.envelopes[-1].call_kind == "side"
    r = _post(stack, body, headers={"x-api-key": ADMIN_KEY, "x-areal-call": "summary"})
    _assert_error(r, 400, "invalid_request_error", "x-areal-call")


def test_stream_event_order_and_the_sdk_accumulated_message(
    stack: Stack, scripted: ScriptedProxy
) -> None:
    r = httpx.post(
        stack.url + "/v1/messages",
        json={
            "model": "a-reason",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "2+2?"}],
            "stream": True,
        },
        headers={"x-api-key": ADMIN_KEY},
        timeout=10,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.content)
    kinds = [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in events]
    n_think = sum(1 for k in kinds if k[2] == "thinking_delta")
    n_text = sum(1 for k in kinds if k[2] == "text_delta")
    assert n_think >= 2 and n_text >= 2
    assert kinds == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        *[("content_block_delta", 0, "thinking_delta")] * n_think,
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        *[("content_block_delta", 1, "text_delta")] * n_text,
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 17, "output_tokens": 5}
    assert events[0]["message"]["id"] == f"msg_{len(scripted.bodies):024x}"

    with _sdk(stack).messages.stream(
        model="a-reason", max_tokens=32, messages=[{"role": "user", "content": "2+2?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Four."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Two and two make four."  # type: ignore[union-attr]
    assert final.usage.input_tokens == 17 and final.usage.output_tokens == 5
    whole = _sdk(stack).messages.create(
        model="a-reason", max_tokens=32, messages=[{"role": "user", "content": "2+2?"}]
    )
    assert [b.model_dump() for b in whole.content] == [b.model_dump() for b in final.content]


def test_async_sdk_stream_and_not(stack: Stack, scripted: ScriptedProxy) -> None:
    async def go() -> tuple[Any, Any]:
        client = anthropic.AsyncAnthropic(base_url=stack.url, api_key=ADMIN_KEY, max_retries=0)
        try:
            whole = await client.messages.create(
                model="a-text", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
            raw = await client.messages.create(
                model="a-text",
                max_tokens=8,
                messages=[{"role": "user", "content": "x"}],
                stream=True,
            )
            types = [e.type async for e in raw]
            return whole, types
        finally:
            await client.close()

    whole, types = asyncio.run(go())
    assert whole.content[0].text == "Hello there, friend."
    assert types[:2] == ["message_start", "content_block_start"]  # the SDK skips ping
    assert types[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_with_tool_use_and_tool_result(
    stack: Stack, scripted: ScriptedProxy, stream: bool
) -> None:
    client = _sdk(stack)
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: dict[str, Any] = {"model": "a-tool", "max_tokens": 64, "tools": [WEATHER]}
    if stream:
        with client.messages.stream(messages=ask, tool_choice={"type": "any"}, **kwargs) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(messages=ask, tool_choice={"type": "any"}, **kwargs)
    assert scripted.bodies[-1]["tool_choice"] == "required"
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.type == "tool_use"
    assert (use.id, use.name, use.input) == ("call_w1", "get_weather", {"city": "Paris"})
    # The follow-up turn: the assistant's blocks as they came, then the tool's result.
    ask += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}],
        },
    ]
    second = client.messages.create(messages=ask, **kwargs)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "The weather: sunny, 24 C"  # type: ignore[union-attr]
    assert scripted.bodies[-1]["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_w1",
                    "type": "function",
                    # Byte for byte what the proxy answered: the lineage links the turns.
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_w1", "content": "sunny, 24 C"},
    ]


def test_stream_tool_use_events(stack: Stack, scripted: ScriptedProxy) -> None:
    r = _post(
        stack,
        {
            "model": "a-tool",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER],
            "stream": True,
        },
    )
    events = _events(r.content)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_w1", "name": "get_weather", "input": {}},
    ]
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    )
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_say_which_one_stopped(
    stack: Stack, scripted: ScriptedProxy, stream: bool
) -> None:
    client = _sdk(stack)

    def ask(stops: list[str]) -> Any:
        kw: dict[str, Any] = {
            "model": "a-stop",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "count"}],
            "stop_sequences": stops,
        }
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message()
        return client.messages.create(**kw)

    m = ask(["END", "STOP"])
    assert scripted.bodies[-1]["stop"] == ["END", "STOP"] and scripted.bodies[-1]["logprobs"]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")
    assert m.content[0].text == "one two "
    m = ask(["END"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    m = ask(["NEVER"])  # the model ended by itself
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)


def test_max_tokens_stop_reason(stack: Stack, scripted: ScriptedProxy) -> None:
    m = _sdk(stack).messages.create(
        model="a-length", max_tokens=3, messages=[{"role": "user", "content": "x"}]
    )
    assert m.stop_reason == "max_tokens"


# --- errors, in Anthropic's shape ---------------------------------------------------------


def test_bad_input_is_a_400_invalid_request_error(stack: Stack, scripted: ScriptedProxy) -> None:
    n = len(scripted.bodies)
    ok = {"model": "a-text", "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_post(stack, ok), 400, "invalid_request_error", "max_tokens: Field required")
    bad_order = {**ok, "max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]}
    _assert_error(_post(stack, bad_order), 400, "invalid_request_error", "messages.0.role")
    unknown = {
        **ok,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "audio"}]}],
    }
    _assert_error(_post(stack, unknown), 400, "invalid_request_error", "'audio'")
    _assert_error(_post(stack, b"{not json"), 400, "invalid_request_error", "JSON")
    with pytest.raises(anthropic.BadRequestError) as ei:
        _sdk(stack).messages.create(
            model="a-text",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                }
            ],
        )
    assert ei.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert len(scripted.bodies) == n  # nothing reached the proxy


def test_auth_errors(stack: Stack) -> None:
    ok = {"model": "a-text", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_post(stack, ok, {}), 401, "authentication_error", "x-api-key")
    _assert_error(_post(stack, ok, {"x-api-key": "nope"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        _sdk(stack, "areal-sk-forged.abc.def").messages.create(**ok)  # type: ignore[arg-type]


def test_upstream_errors_get_anthropic_status_codes(stack: Stack, scripted: ScriptedProxy) -> None:
    ask = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_post(stack, {"model": "no-such", **ask}), 404, "not_found_error", "no-such")
    _assert_error(_post(stack, {"model": "a-busy", **ask}), 529, "overloaded_error")
    _assert_error(_post(stack, {"model": "a-limited", **ask}), 429, "rate_limit_error")
    with pytest.raises(anthropic.InternalServerError) as ei:  # the SDK's class for 529
        _sdk(stack).messages.create(model="a-busy", **ask)  # type: ignore[arg-type]
    assert ei.value.status_code == 529
    big = {"model": "a-text", **ask, "system": "x" * MAX_BODY}
    _assert_error(_post(stack, big), 413, "request_too_large")


def test_a_failure_mid_stream_is_an_error_event(stack: Stack, scripted: ScriptedProxy) -> None:
    r = _post(
        stack,
        {
            "model": "a-text",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "fail midway"}],
            "stream": True,
        },
    )
    events = _events(r.content)
    assert events[0]["type"] == "message_start"
    assert events[-1] == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the engine refused the rest"},
    }
    with pytest.raises(anthropic.APIStatusError):
        with _sdk(stack).messages.stream(
            model="a-text", max_tokens=8, messages=[{"role": "user", "content": "fail midway"}]
        ) as s:
            list(s)


def test_other_methods(stack: Stack) -> None:
    r = httpx.get(stack.url + "/v1/messages", headers={"x-api-key": ADMIN_KEY})
    _assert_error(r, 405, "invalid_request_error", "GET")
    assert r.headers["allow"] == "POST"
    r = httpx.get(stack.url + "/v1/messages/count_tokens", headers={"x-api-key": ADMIN_KEY})
    _assert_error(r, 405, "invalid_request_error", "GET")


# --- fuzz: no body is a 500, every error is Anthropic's shape -------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-2, 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
BLOCK = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "tool_use", "tool_result", "thinking", "image", "redacted_thinking", "x"]
        )
        | JSON
    },
    optional={
        "text": st.text(max_size=5) | JSON,
        "id": st.sampled_from(["c1", ""]) | JSON,
        "tool_use_id": st.just("c1") | JSON,
        "name": st.just("get_weather") | JSON,
        "input": st.just({"city": "x"}) | JSON,
        "content": st.text(max_size=5) | JSON,
        "thinking": st.text(max_size=5) | JSON,
        "is_error": st.booleans() | JSON,
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON},
    optional={"content": st.text(max_size=5) | st.lists(BLOCK, max_size=3) | JSON},
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("a-text") | JSON,
        "max_tokens": st.integers(-1, 4) | JSON,
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "system": st.text(max_size=4) | st.lists(BLOCK, max_size=2) | JSON,
        "stream": st.booleans() | JSON,
        "stop_sequences": st.lists(st.text(max_size=3), max_size=5) | JSON,
        "tools": st.lists(
            st.sampled_from(
                [
                    WEATHER,
                    {**WEATHER, "name": "later", "defer_loading": True},
                    {"type": "web_search_20250305", "name": "web_search"},
                ]
            )
            | JSON,
            max_size=2,
        )
        | JSON,
        "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "x"}]) | JSON,
        "thinking": st.just({"type": "enabled", "budget_tokens": 1024}) | JSON,
        "temperature": st.floats(-1, 2) | JSON,
        "top_k": st.integers(-2, 5) | JSON,
        "metadata": JSON,
        "output_config": st.just({"effort": "high"}) | JSON,
        "context_management": st.sampled_from(
            [
                {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                {"edits": [{"type": "clear_thinking_20251015"}]},
                {"edits": [{"type": "clear_tool_uses_20250919"}]},
            ]
        )
        | JSON,
    },
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(BODY)
def test_translate_refuses_any_body_with_a_400_or_translates_it(doc: dict) -> None:
    try:
        t = translate(doc)
    except InvalidRequest as err:
        assert err.http_status == 400 and err.message
        return
    assert t.chat["messages"] and t.chat["max_tokens"] >= 1


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(BODY)
def test_no_body_is_a_500_through_the_gateway(
    stack: Stack, scripted: ScriptedProxy, doc: dict
) -> None:
    r = _post(stack, doc)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        _assert_error(r, r.status_code, r.json()["error"]["type"])
