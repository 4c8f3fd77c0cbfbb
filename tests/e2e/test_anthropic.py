"""Anthropic's Messages API on the inference gateway through real processes (router, gateway,
proxy) in front of the real SGLang engine on the CPU, with the official `anthropic` SDK
(sync, async, stream and not), unchanged: `base_url` is the gateway.

A Messages call is a chat completion underneath (the gateway translates), so with a session
key it is recorded on the session like a chat: the exported tokens are the ones the message
carried. The parrot model's weights are random; the tool call below is the proxy's forced
call (`tool_choice: any` -> `required`, constrained decoding in the hermes format), and the
stop sequence is a piece of that call's known text.
"""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT
from tokenizers import Tokenizer

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
GREEDY = {"temperature": 0}  # a body field: the SDK (2.x) has no argument for it
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("anthropic"),
        sglang_engine.url,
        PARROT,
        n_proxies=1,
        proxy_args=["--tool-call-parser", "hermes", "--chat-template-type", "hf"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))


def _admin(stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
    )


def _session(stack) -> dict:
    with _admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": "anthropic", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    return sess


def _export(stack, session_id: str) -> list[dict]:
    with _admin(stack) as c:
        r = c.post(
            "/rl/export_trajectories", json={"session_ids": [session_id], "style": "individual"}
        )
    assert r.status_code == 200, r.text
    return r.json()["rows"]


def _sdk(stack, key: str = ADMIN_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=key, max_retries=0, timeout=120)


def _ask(**kw) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "system": "Repeat.",
        "messages": [{"role": "user", "content": "Hello there"}],
        "extra_body": GREEDY,
        **kw,
    }


def test_sync_async_and_stream_with_the_official_sdk(stack):
    m = _sdk(stack).messages.create(**_ask())
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"]
    assert m.usage.input_tokens > 0 and 1 <= m.usage.output_tokens <= 4

    async def go():
        client = anthropic.AsyncAnthropic(
            base_url=stack.gateway_url, api_key=ADMIN_KEY, max_retries=0, timeout=120
        )
        try:
            whole = await client.messages.create(**_ask())
            async with client.messages.stream(**_ask()) as s:
                streamed = await s.get_final_message()
            return whole, streamed
        finally:
            await client.close()

    a, a_stream = asyncio.run(go())
    assert a.content[0].text == m.content[0].text  # greedy: the same answer
    with _sdk(stack).messages.stream(**_ask()) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    for streamed in (final, a_stream):
        assert streamed.content[0].text == m.content[0].text  # type: ignore[union-attr]
        assert streamed.stop_reason == m.stop_reason
        assert streamed.usage.input_tokens == m.usage.input_tokens
        assert streamed.usage.output_tokens == m.usage.output_tokens


def test_a_session_key_records_messages_like_chats(stack, tok):
    sess = _session(stack)
    client = _sdk(stack, sess["session_api_key"])
    first = client.messages.create(**_ask(messages=[{"role": "user", "content": "What is 2 + 3?"}]))
    follow = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "and then?"},
    ]
    with client.messages.stream(**_ask(messages=follow)) as s:
        second = s.get_final_message()
    rows = _export(stack, sess["session_id"])
    assert len(rows) == 2
    for row, msg in zip(rows, (first, second), strict=True):
        # The recorded interaction is the message: its id, its tokens, their logprobs.
        assert row["interaction_id"] == "chatcmpl-" + msg.id.removeprefix("msg_")
        out = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert len(out) == msg.usage.output_tokens
        assert tok.decode(out, skip_special_tokens=True) == msg.content[0].text
        assert len(row["logprobs"]) == len(row["versions"]) == len(row["input_ids"])
        assert any(lp != 0 for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m)
    prompt = [t for t, m in zip(rows[1]["input_ids"], rows[1]["loss_mask"], strict=True) if not m]
    text = tok.decode(prompt, skip_special_tokens=False)
    assert "What is 2 + 3?" in text and "and then?" in text and "Repeat." in text


def _forced(**kw) -> dict:
    """A forced call at the default temperature 1 (greedy, the parrot pads the JSON with
    blanks until max_tokens), one call at a time."""
    return {
        "model": MODEL,
        "max_tokens": 96,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        **kw,
    }


def test_a_forced_tool_use_then_its_tool_result(stack):
    client = _sdk(stack)
    m = client.messages.create(**_forced())
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"} and uses[0].input["city"] in ("Paris", "Rome", "Oslo")  # type: ignore[index,operator]
    with client.messages.stream(**_forced()) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    [use] = [b for b in streamed.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome", "Oslo")  # type: ignore[index]
    ask = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}],
        },
    ]
    done = client.messages.create(**_ask(messages=ask, tools=[TOOL]))
    assert done.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert done.usage.input_tokens > m.usage.input_tokens  # the call and its result were read


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(stack, stream):
    # Greedy, the parrot writes only line breaks; a forced call's text is known in advance
    # (`<tool_call>\n{"name": "get_weather", ...`), so a stop sequence inside it must hit.
    stop = '"get_weather"'
    kw = _forced(stop_sequences=["NEVER-STOP-HERE", stop])
    if stream:
        with _sdk(stack).messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = _sdk(stack).messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop), m
    assert not [b for b in m.content if b.type == "tool_use"]  # cut before the call was whole
    assert all(stop not in b.text for b in m.content if b.type == "text")  # type: ignore[union-attr]
    free = _sdk(stack).messages.create(**_forced(stop_sequences=["NEVER-STOP-HERE"]))
    assert (free.stop_reason, free.stop_sequence) == ("tool_use", None)


def test_errors_are_anthropic_shaped_sdk_exceptions(stack):
    with pytest.raises(anthropic.BadRequestError) as ei:
        _sdk(stack).messages.create(
            **_ask(
                messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
            )
        )
    assert ei.value.status_code == 400
    assert ei.value.body["type"] == "error"  # type: ignore[index]
    assert ei.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "prefill" in ei.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as ei2:
        _sdk(stack, "not-a-key").messages.create(**_ask())
    assert ei2.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
