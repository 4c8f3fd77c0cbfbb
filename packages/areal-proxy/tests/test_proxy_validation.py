"""Every bad request body is a 400 (INVALID_ARGUMENT + areal-error-bin) naming the param."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, request, start

MSG = [{"role": "user", "content": "hi"}]

CHAT_CASES: list[tuple[Any, str]] = [
    (b"{not json", ""),
    (b"[1, 2]", ""),
    (b'"text"', ""),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "5"}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": MSG, "n": 65}, "n"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 5}, "temperature"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "presence_penalty": True}, "presence_penalty"),
    ({"messages": MSG, "stop": 3}, "stop"),
    ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "logprobs": "yes"}, "logprobs"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stream_options": "yes"}, "stream_options"),
    ({"messages": MSG, "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"messages": MSG, "tools": "x"}, "tools"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": MSG, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "seed": 1.5}, "seed"),
    ({"messages": MSG, "top_k": -5}, "top_k"),
    ({"messages": MSG, "logit_bias": {"1": "x"}}, "logit_bias"),
    ({"messages": MSG, "model": 3}, "model"),
    # Nothing accepted and ignored: an unknown field, or one areal cannot honour, is named.
    ({"messages": MSG, "frobnicate": 1}, "frobnicate"),
    ({"messages": MSG, "store": True}, "store"),
    ({"messages": MSG, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": MSG, "response_format": "json"}, "response_format"),
    ({"messages": MSG, "regex": 5}, "regex"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
]

COMPLETION_CASES: list[tuple[Any, str]] = [
    (b"nope", ""),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "tools": []}, "tools"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
]


@pytest.fixture
async def proxy():
    h = await start(FakeEngineClient([5, 6, EOS]))
    yield h
    await h.close()


async def _expect_400(call, body: Any, param: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call(request(body))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = error_detail(ei.value)
    assert d.http_status == 400
    assert d.type == "invalid_request_error"
    assert d.param == param, d.message
    return d.message


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
async def test_chat_rejects(proxy, body, param):
    await _expect_400(proxy.stub.ChatCompletion, body, param)
    assert proxy.engine.requests == []


@pytest.mark.parametrize(("body", "param"), CHAT_CASES[:12])
async def test_chat_stream_rejects_before_any_chunk(proxy, body, param):
    async def call(req):
        return [c async for c in proxy.stub.ChatCompletionStream(req)]

    await _expect_400(call, body, param)


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES)
async def test_completion_rejects(proxy, body, param):
    await _expect_400(proxy.stub.Completion, body, param)
    assert proxy.engine.requests == []


async def test_unsupported_parameter_is_named_with_its_code(proxy):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await proxy.stub.ChatCompletion(request({"messages": MSG, "audio": {"voice": "x"}}))
    d = error_detail(ei.value)
    assert (d.http_status, d.param, d.code) == (400, "audio", "unsupported_parameter")
    assert "docs/openai-api.md" in d.message


async def test_null_means_not_given_for_any_field(proxy):
    body = {"messages": MSG, "frobnicate": None, "audio": None, "verbosity": None}
    r = await proxy.stub.ChatCompletion(request(body))
    assert r.body


async def test_informational_fields_are_accepted(proxy):
    body = {"messages": MSG, "user": "u1", "metadata": {"k": "v"}, "store": False}
    r = await proxy.stub.ChatCompletion(request(body))
    assert r.body


async def test_prompt_longer_than_context():
    h = await start(FakeEngineClient([5, EOS]), context_length=10)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.ChatCompletion(request({"messages": MSG}))
        d = error_detail(ei.value)
        assert (d.http_status, d.param, d.code) == (400, "messages", "context_length_exceeded")
        assert "context length is 10" in d.message
    finally:
        await h.close()


async def test_informational_fields_accepted_and_extensions_forwarded(proxy):
    body = {
        "messages": MSG,
        "user": "u1",
        "metadata": {"k": "v"},
        "response_format": {"type": "text"},
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "seed": 3,
        "ignore_eos": False,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop_token_ids": [7],
        "logit_bias": {"5": 1.0},
    }
    out = await proxy.chat(body)
    assert out["choices"][0]["finish_reason"] == "stop"
    (req,) = proxy.engine.requests
    assert (req.top_k, req.min_p, req.repetition_penalty, req.seed) == (5, 0.1, 1.1, 3)
    assert (req.frequency_penalty, req.presence_penalty) == (0.5, -0.5)
    assert (req.temperature, req.top_p) == (0.7, 0.9)
    assert 7 in req.stop_token_ids and EOS in req.stop_token_ids
    assert req.extra == {"logit_bias": {"5": 1.0}}
    assert req.constraint is None  # response_format "text" constrains nothing


async def test_content_parts_and_tool_messages_render(proxy):
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    }
    await proxy.chat(body)
    text = proxy.tok.decode(proxy.engine.requests[0].input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert '<tool_call>{"name": "w", "arguments": {}}</tool_call>' in text
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
