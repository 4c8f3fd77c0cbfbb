"""OpenAI response shapes: chat / completions, whole and streamed, logprobs, usage, stop
strings, max_tokens capping, tool calls and reasoning through the parsers."""

from __future__ import annotations

import pytest
from proxy_fakes import EOS, FakeEngineClient, lp_of, start, wait_for

MSG = [{"role": "user", "content": "hi"}]
TEXT = "héllo 你好 wörld"


def _chat_text(chunks):
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.fixture
async def proxy():
    engine = FakeEngineClient([])
    h = await start(engine)
    engine.sequence = [*h.tok.encode(TEXT), EOS]
    yield h
    await h.close()


async def test_chat_completion_shape(proxy):
    out = await proxy.chat({"messages": MSG, "model": "whatever"})
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "tiny-parrot" and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": TEXT, "refusal": None}
    assert choice["logprobs"] is None
    n = len(proxy.engine.sequence)
    prompt = len(proxy.engine.requests[0].input_ids)
    assert out["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": n,
        "total_tokens": prompt + n,
    }
    (rec,) = proxy.records
    assert rec.token_ids == proxy.engine.sequence and rec.versions == [0] * n


async def test_chat_logprobs_shape(proxy):
    out = await proxy.chat({"messages": MSG, "logprobs": True, "top_logprobs": 2})
    content = out["choices"][0]["logprobs"]["content"]
    seq = proxy.engine.sequence
    assert [e["logprob"] for e in content] == [lp_of(t) for t in seq]
    assert b"".join(bytes(e["bytes"]) for e in content[:-1]).decode() == TEXT
    for e, t in zip(content, seq, strict=True):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert [x["logprob"] for x in e["top_logprobs"]] == [lp_of(t), lp_of(t) - 1.0]
        assert set(e["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert proxy.engine.requests[0].top_logprobs == 2
    out = await proxy.chat({"messages": MSG, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in out["choices"][0]["logprobs"]["content"])


async def test_chat_stream_shape_and_equals_whole(proxy):
    whole = await proxy.chat({"messages": MSG, "logprobs": True})
    chunks = await proxy.chat_stream(
        {
            "messages": MSG,
            "stream": True,
            "logprobs": True,
            "stream_options": {"include_usage": True},
        }
    )
    first, last, final = chunks[0], chunks[-1], chunks[-2]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"].get("role") is None for c in chunks[1:-1])
    assert {c["id"] for c in chunks} == {first["id"]} and first["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert final["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert _chat_text(chunks) == whole["choices"][0]["message"]["content"] == TEXT
    lps = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert lps == whole["choices"][0]["logprobs"]["content"]
    # Streamed for real: one chunk per engine token (no text lost to a multibyte split).
    assert len(
        [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    ) == len(proxy.engine.sequence)


async def test_stream_without_usage_has_no_usage_field(proxy):
    chunks = await proxy.chat_stream({"messages": MSG})
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completion_shape_and_prompt_forms(proxy):
    ids = proxy.tok.encode("ab")
    for prompt in ("ab", ["ab"], ids, [ids]):
        out = await proxy.completion({"prompt": prompt, "logprobs": 1})
        assert proxy.engine.requests[-1].input_ids == ids
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        (choice,) = out["choices"]
        assert choice["text"] == TEXT and choice["finish_reason"] == "stop"
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert lp["token_logprobs"] == [lp_of(t) for t in proxy.engine.sequence]
        assert len(lp["top_logprobs"]) == len(lp["tokens"]) and len(lp["top_logprobs"][0]) == 1
        assert lp["text_offset"][0] == 0
        assert out["usage"]["prompt_tokens"] == len(ids)


async def test_completion_stream_equals_whole(proxy):
    whole = await proxy.completion({"prompt": "ab", "logprobs": 0, "echo": True})
    chunks = await proxy.completion_stream(
        {"prompt": "ab", "logprobs": 0, "echo": True, "stream_options": {"include_usage": True}}
    )
    assert whole["choices"][0]["text"] == "ab" + TEXT
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "ab" + TEXT
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    streamed = [
        x
        for c in chunks[:-1]
        if c["choices"][0]["logprobs"]
        for x in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
    assert whole["choices"][0]["logprobs"]["text_offset"][0] == 2
    assert whole["choices"][0]["logprobs"]["top_logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_ends_text_and_engine(proxy, stream):
    # The fake engine ignores `stop`: the proxy cuts the text and aborts the engine request.
    body = {"messages": MSG, "stop": ["wö", "zzz"]}
    if stream:
        chunks = await proxy.chat_stream(body)
        text, finish = _chat_text(chunks), chunks[-1]["choices"][0]["finish_reason"]
        await wait_for(lambda: proxy.engine.aborted)
        assert proxy.engine.aborted == [proxy.engine.requests[0].rid]
        assert proxy.engine.tokens_sent < len(proxy.engine.sequence)
    else:
        out = await proxy.chat(body)
        text, finish = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
    assert text == "héllo 你好 " and finish == "stop"
    assert proxy.engine.requests[0].extra["stop"] == ["wö", "zzz"]


async def test_stop_string_split_across_tokens_is_never_leaked(proxy):
    chunks = await proxy.chat_stream({"messages": MSG, "stop": "好 w"})
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == "héllo 你"
    assert not any("好" in p for p in pieces)


async def test_max_tokens_is_capped_by_engine_max_and_context():
    engine = FakeEngineClient(list(range(10, 60)))
    h = await start(engine, engine_max_tokens=7, context_length=40)
    try:
        out = await h.chat({"messages": MSG, "max_tokens": 100})
        prompt = len(engine.requests[0].input_ids)
        assert engine.requests[0].max_new_tokens == 7
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 7
        await h.chat({"messages": MSG, "max_completion_tokens": 3})
        assert engine.requests[1].max_new_tokens == 3
    finally:
        await h.close()
    engine = FakeEngineClient([5, EOS])
    h = await start(engine, context_length=40)
    try:
        await h.chat({"messages": MSG})
        assert engine.requests[0].max_new_tokens == 40 - prompt
        await h.chat({"messages": MSG, "max_tokens": 1000})
        assert engine.requests[1].max_new_tokens == 40 - prompt
    finally:
        await h.close()


async def test_ignore_eos_drops_eos_from_stop_ids(proxy):
    await proxy.chat({"messages": MSG, "ignore_eos": True, "max_tokens": 3})
    req = proxy.engine.requests[0]
    assert req.ignore_eos and EOS not in req.stop_token_ids


async def test_tool_calls_with_hermes_parser():
    engine = FakeEngineClient([])
    h = await start(engine, tool_call_parser="hermes", reasoning_parser="qwen3")
    text = '<think>need weather</think>Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine.sequence = [*h.tok.encode(text), EOS]
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    try:
        out = await h.chat({"messages": MSG, "tools": tools})
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["reasoning_content"] == "need weather"
        assert msg["content"] == "Checking."
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"].replace(" ", "") == '{"city":"Paris"}'

        chunks = await h.chat_stream({"messages": MSG, "tools": tools})
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
        args = "".join(tc["function"].get("arguments", "") for tc in calls)
        assert args.replace(" ", "") == '{"city":"Paris"}'
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

        # tool_choice "none": no tool parsing, the text stays content.
        out = await h.chat({"messages": MSG, "tools": tools, "tool_choice": "none"})
        assert "tool_calls" not in out["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()
