"""`CountTokens`: a chat body's prompt size with the model's own template and tokenizer,
nothing generated or recorded (the gateway's `POST /v1/messages/count_tokens`).

The real proxy server (gRPC on loopback) with tiny-parrot's tokenizer in front of the FAKE
engine of proxy_fakes; the count is checked against what a chat completion of the same body
actually sent the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from proxy_fakes import EOS, PARROT, FakeEngineClient, error_detail, request, start

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
BODY: dict[str, Any] = {
    "model": "tiny-parrot",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Error: no network"},
        # Mid-conversation system message, as Claude Code sends one after the last turn.
        {"role": "system", "content": "The working directory is /tmp."},
    ],
    "tools": TOOLS,
    "chat_template_kwargs": {"reasoning_effort": "high"},
    "max_tokens": 4,
}


@pytest.fixture
async def proxy():
    h = await start(FakeEngineClient([5, 6, EOS]))
    yield h
    await h.close()


async def test_the_count_is_the_prompt_a_chat_sends_the_engine(proxy):
    counted = (await proxy.stub.CountTokens(request(BODY))).input_tokens
    assert proxy.engine.requests == [] and proxy.records == []  # nothing generated
    answer = await proxy.chat(BODY)
    sent = proxy.engine.requests[-1].input_ids
    assert counted == len(sent) == answer["usage"]["prompt_tokens"]
    # The tools are in it: without them the prompt is shorter.
    bare = (await proxy.stub.CountTokens(request({**BODY, "tools": None}))).input_tokens
    assert 0 < bare < counted


async def test_a_bad_body_is_the_chat_400_and_nothing_runs(proxy):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await proxy.stub.CountTokens(request({"model": "m", "messages": "nope"}))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = error_detail(ei.value)
    assert d.http_status == 400 and d.param == "messages", d.message
    assert proxy.engine.requests == []


async def test_a_body_with_more_structure_than_a_request_may_have_is_refused(proxy):
    # No prompt screen on this path: the body is counted, not parsed, and refused.
    blocks = [{"type": "text", "text": ""}] * 200_000
    body = {"messages": [{"role": "user", "content": blocks}]}
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await proxy.stub.CountTokens(request(body))
    d = error_detail(ei.value)
    assert (d.http_status, d.code) == (413, "body_too_complex"), d.message
    # A long conversation of prose is still counted.
    long = {"messages": [{"role": "user", "content": "word " * 100_000}]}
    assert (await proxy.stub.CountTokens(request(long))).input_tokens > 50_000


async def test_a_template_that_refuses_is_a_400_chat_template_error(tmp_path: Path):
    """A template that refuses a system message after the first (some do) says so as a 400
    with the template's words, never a 500."""
    model = tmp_path / "strict"
    model.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(PARROT / name, model / name)
    config = json.loads((PARROT / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- for m in messages %}{%- if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}"
        "{%- endif %}{%- endfor %}" + config["chat_template"]
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    h = await start(FakeEngineClient([5, EOS]), tokenizer_path=str(model))
    try:
        for call in (h.stub.CountTokens, h.stub.ChatCompletion):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(request(BODY))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            d = error_detail(ei.value)
            assert (d.http_status, d.code, d.param) == (400, "chat_template_error", "messages")
            assert "System message must be at the beginning." in d.message
        assert h.engine.requests == []
        ok = {**BODY, "messages": BODY["messages"][:2]}
        assert (await h.stub.CountTokens(request(ok))).input_tokens > 0
    finally:
        await h.close()
