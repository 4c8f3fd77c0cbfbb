"""n choices, lists of prompts, structured outputs and forced tool calls, through the real
ProxyServer (gRPC on loopback) and a fake engine; the engine payloads they become."""

from __future__ import annotations

import asyncio
import json

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, request, start, wait_for
from test_proxy_sessions import _export, _group

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.engine.base import JSON_MAX_WHITESPACE, GenerationRequest
from areal_proxy.engine.sglang import _payload as sglang_payload
from areal_proxy.engine.vllm import _payload as vllm_payload
from areal_proxy.inference.forced_tools import Scaffold, forced_constraint

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 52), EOS]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture
async def proxy():
    h = await start(FakeEngineClient(SEQ))
    yield h
    await h.close()


async def _reject(call, body, param, code=None):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call(request(body))
    d = error_detail(ei.value)
    assert (d.http_status, d.param) == (400, param), d.message
    if code:
        assert d.code == code, d.message
    return d.message


# ---- n and lists of prompts ------------------------------------------------------------


async def test_n_chat_gives_n_choices_from_n_engine_generations(proxy):
    out = await proxy.chat({"messages": MSG, "n": 3, "logprobs": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    text = proxy.tok.decode(SEQ[:-1])
    assert all(c["message"]["content"] == text for c in out["choices"])
    assert all(len(c["logprobs"]["content"]) == len(SEQ) for c in out["choices"])
    assert len(proxy.engine.requests) == 3
    assert len({r.rid for r in proxy.engine.requests}) == 3  # each abortable on its own
    prompt = len(proxy.engine.requests[0].input_ids)
    assert out["usage"]["completion_tokens"] == 3 * len(SEQ)
    assert out["usage"]["prompt_tokens"] == 3 * prompt


async def test_n_chat_stream_carries_each_choice_index_to_its_end(proxy):
    chunks = await proxy.chat_stream(
        {"messages": MSG, "n": 2, "stream_options": {"include_usage": True}}
    )
    text = proxy.tok.decode(SEQ[:-1])
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in mine) == text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * len(SEQ)


async def test_completion_prompt_list_times_n_orders_choices_by_prompt(proxy):
    out = await proxy.completion({"prompt": [[5, 6], [7, 8]], "n": 2, "echo": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    body = proxy.tok.decode(SEQ[:-1])
    first, second = proxy.tok.decode([5, 6]), proxy.tok.decode([7, 8])
    assert [c["text"] for c in out["choices"]] == [first + body] * 2 + [second + body] * 2
    assert sorted(r.input_ids for r in proxy.engine.requests) == [[5, 6], [5, 6], [7, 8], [7, 8]]

    chunks = await proxy.completion_stream({"prompt": [[5, 6], [7, 8]], "max_tokens": 3})
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1]


async def test_each_choice_is_its_own_recorded_interaction():
    h = await start(FakeEngineClient(SEQ))
    try:
        [(sid, key)] = await _group(h)
        out = await h.chat({"messages": MSG, "n": 3}, api_key=key, session_id=sid)
        rows = await _export(h, session_ids=[sid])
        assert len(rows) == 3
        assert {r["response_id"] for r in rows} == {out["id"]}
        assert sorted(r["choice_index"] for r in rows) == [0, 1, 2]
        assert sorted(r["interaction_id"] for r in rows) == [f"{out['id']}-{i}" for i in range(3)]
        # A group's rewards go to each choice by its interaction id, and the choices of one
        # request are alternatives: no discounting from one into another.
        for i, reward in ((1, 1.0), (2, 0.5)):
            await h.stub.SetReward(
                proxy_pb2.SetRewardRequest(
                    session_id=sid,
                    interaction_id=f"{out['id']}-{i}",
                    reward=reward,
                    envelope=envelope_pb2.Envelope(api_key=key, session_id=sid),
                )
            )
        rows = await _export(h, session_ids=[sid], discount=1.0)
        assert {x["choice_index"]: x["reward"] for x in rows} == {0: 0.0, 1: 1.0, 2: 0.5}
        # One choice, as before: the interaction id is the response id.
        [(sid2, key2)] = await _group(h)
        one = await h.chat({"messages": MSG}, api_key=key2, session_id=sid2)
        rows = await _export(h, session_ids=[sid2])
        assert [(x["interaction_id"], x["response_id"], x["choice_index"]) for x in rows] == [
            (one["id"], one["id"], 0)
        ]
    finally:
        await h.close()


async def test_a_failing_choice_fails_the_request_and_stops_the_others():
    engine = FakeEngineClient(SEQ, delay=0.01)
    h = await start(engine)
    try:
        task = asyncio.create_task(h.chat({"messages": MSG, "n": 4}))
        await wait_for(lambda: len(engine.requests) == 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: h.server.controller.inflight == {})
    finally:
        await h.close()


# ---- structured outputs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "kind", "value"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            SCHEMA,
        ),
        ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),
        ({"response_format": {"type": "regex", "regex": "(yes|no)"}}, "regex", "(yes|no)"),
        ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"ebnf": 'root ::= "a" | "b"'}, "ebnf", 'root ::= "a" | "b"'),
    ],
)
async def test_constraints_reach_the_engine_request(proxy, extra, kind, value):
    # An answer that meets each schema (a JSON-schema output is checked before it is returned).
    proxy.engine.sequence = [*proxy.tok.encode('{"city": "Paris"}'), EOS]
    await proxy.chat({"messages": MSG, **extra})
    await proxy.completion({"prompt": "x", **extra})
    for req in proxy.engine.requests:
        assert req.constraint is not None and req.constraint[0] == kind
        got = json.loads(req.constraint[1]) if kind == "json_schema" else req.constraint[1]
        assert got == value


async def test_two_constraints_are_refused(proxy):
    body = {"messages": MSG, "regex": "a", "response_format": {"type": "json_object"}}
    await _reject(proxy.stub.ChatCompletion, body, "response_format")
    assert proxy.engine.requests == []


def test_engine_payloads_carry_the_constraint():
    req = GenerationRequest(input_ids=[1], max_new_tokens=4, constraint=("regex", "a+"))
    assert orjson.loads(sglang_payload(req, False))["sampling_params"]["regex"] == "a+"
    assert orjson.loads(vllm_payload(req, "m", False))["structured_outputs"] == {"regex": "a+"}
    req.constraint = ("ebnf", "root ::= x")
    assert orjson.loads(vllm_payload(req, "m", False))["structured_outputs"] == {
        "grammar": "root ::= x"
    }
    # A JSON schema goes as a structural tag that bounds whitespace runs, to both engines.
    req.constraint = ("json_schema", '{"type": "object"}')
    tag = orjson.loads(sglang_payload(req, False))["sampling_params"]["structural_tag"]
    assert orjson.loads(vllm_payload(req, "m", False))["structured_outputs"] == {
        "structural_tag": tag
    }
    fmt = orjson.loads(tag)["format"]
    assert fmt == {
        "type": "json_schema",
        "json_schema": {"type": "object"},
        "max_whitespace_cnt": JSON_MAX_WHITESPACE,
    }
    req.constraint = None
    assert "structured_outputs" not in orjson.loads(vllm_payload(req, "m", False))
    params = orjson.loads(sglang_payload(req, False))["sampling_params"]
    assert not {"json_schema", "structural_tag", "regex"} & set(params)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pause_restarts_a_constrained_generation_from_its_prompt(stream):
    engine = FakeEngineClient([], delay=0.01)
    h = await start(engine)
    seq = engine.sequence = [*h.tok.encode('{"a": [1, 2, 3, 4, 5, 6]}'), EOS]
    try:
        body = {"messages": MSG, "response_format": {"type": "json_object"}}
        call = h.chat_stream(body) if stream else h.chat(body)
        task = asyncio.create_task(call)
        await wait_for(lambda: engine.tokens_sent >= 3)
        await h.stub.Pause(proxy_pb2.PauseRequest())
        await h.stub.Continue(proxy_pb2.ContinueRequest())
        if stream:
            # Part of it was already sent: the grammar cannot resume, so the stream says so.
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await asyncio.wait_for(task, 5)
            assert error_detail(ei.value).http_status == 503
            assert "send the request again" in error_detail(ei.value).message
        else:
            out = await asyncio.wait_for(task, 5)
            first, second = engine.requests
            assert second.input_ids == first.input_ids  # from the prompt, not prompt + partial
            (rec,) = h.records
            assert rec.token_ids == seq and rec.attempts == 2
            assert out["choices"][0]["message"]["content"] == h.tok.decode(seq[:-1])
    finally:
        await h.close()


# ---- forced tool calls -----------------------------------------------------------------


async def _tool_proxy(parser="hermes", reasoning="", token_ids=True):
    return await start(
        FakeEngineClient([]),
        tool_call_parser=parser,
        reasoning_parser=reasoning,
        forced_call_token_ids=token_ids,
    )


async def test_required_tool_choice_constrains_to_calls_in_the_parser_format():
    h = await _tool_proxy()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    h.engine.sequence = [*h.tok.encode(text), EOS]
    try:
        out = await h.chat({"messages": MSG, "tools": TOOLS, "tool_choice": "required"})
        (req,) = h.engine.requests
        kind, value = req.constraint
        tag = json.loads(value)
        assert kind == "structural_tag" and tag["type"] == "structural_tag"
        # A call, then at most one more (two tools offered), "\n" between them.
        first, more = tag["format"]["elements"]
        assert (more["type"], more["min"], more["max"]) == ("repeat", 0, 1)
        *sep, again = more["content"]["elements"]
        assert again == first
        # "\n" as the tokenizer's id: it does not merge with the calls around it.
        assert sep == [{"type": "token", "token": i} for i in h.tok.encode("\n")]
        assert first["type"] == "or"
        spelt = [_spell(h.tok, c) for c in first["elements"]]
        assert [head for head, _, _ in spelt] == [
            '<tool_call>\n{"name": "get_weather", "arguments": ',
            '<tool_call>\n{"name": "get_time", "arguments": ',
        ]
        assert spelt[0][1] == SCHEMA
        assert spelt[0][2] == "}\n</tool_call>"
        # The constrained text is exactly what the parser reads back.
        (call,) = out["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
        assert out["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        await h.close()


def _spell(tok, call):
    """(the text before the arguments, their schema, the text after) of one forced call's
    constraint, its token ids decoded."""
    if call["type"] == "tag":  # without --forced-call-token-ids
        return call["begin"], call["content"]["json_schema"], call["end"]
    parts: list[str] = [""]
    ids: list[int] = []
    schema = None
    for e in call["elements"]:
        if e["type"] == "token":
            ids.append(e["token"])
            continue
        parts[-1] += tok.decode(ids)
        ids = []
        if e["type"] == "json_schema":
            schema = e["json_schema"]
            parts.append("")
        else:
            assert e["type"] == "const_string", e
            parts[-1] += e["value"]
    parts[-1] += tok.decode(ids)
    head, tail = parts
    return head, schema, tail


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
async def test_a_forced_calls_fixed_text_is_the_tokenizers_own_ids(choice):
    """Held as text, a forced call's scaffold could be sampled in any tokens that
    spell it (SmolLM2 at t=1: `<`,`t`,`oo`,`l`,... 55 tokens for a 34-token call), so RL
    trained on sequences the model never writes. Its fixed text is now the ids the tokenizer
    gives it in a whole call; only the seams next to the model's arguments stay text."""
    h = await _tool_proxy()
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Rome"}}\n</tool_call>'
    h.engine.sequence = [*h.tok.encode(text), EOS]
    try:
        body = {"messages": MSG, "tools": [tool], "tool_choice": choice}
        out = await h.chat(body)
        fmt = json.loads(h.engine.requests[0].constraint[1])["format"]
        els = fmt["elements"]
        k = [e["type"] for e in els].index("json_schema")
        head = [e["token"] for e in els[: k - 1]]
        tail = [e["token"] for e in els[k + 2 :]]
        assert all(e["type"] == "token" for e in [*els[: k - 1], *els[k + 2 :]]), els
        # The parrot's tokenizer merges the space before the arguments and the brace after
        # them with the model's own text: those two stay text.
        assert (els[k - 1], els[k + 1]) == (
            {"type": "const_string", "value": " "},
            {"type": "const_string", "value": "}"},
        )
        whole = h.tok.encode(text)
        assert head == h.tok.encode('<tool_call>\n{"name": "f", "arguments":')
        assert tail == h.tok.encode("\n</tool_call>")
        assert whole[: len(head)] == head and whole[-len(tail) :] == tail
        assert _spell(h.tok, fmt) == (
            '<tool_call>\n{"name": "f", "arguments": ',
            SCHEMA,
            "}\n</tool_call>",
        )
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
    finally:
        await h.close()


async def test_without_the_flag_a_forced_calls_fixed_text_is_text():
    # Off by default: SGLang 0.5.23 intermittently fails token elements (forced_tools.py).
    h = await _tool_proxy(token_ids=False)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    h.engine.sequence = [*h.tok.encode(text), EOS]
    try:
        await h.chat({"messages": MSG, "tools": TOOLS[:1], "tool_choice": "required"})
        fmt = json.loads(h.engine.requests[0].constraint[1])["format"]
        assert fmt["type"] == "tag" and '"token"' not in json.dumps(fmt)
        assert _spell(h.tok, fmt) == (
            '<tool_call>\n{"name": "get_weather", "arguments": ',
            SCHEMA,
            "}\n</tool_call>",
        )
    finally:
        await h.close()


def test_a_scaffold_the_tokenizer_does_not_merge_has_no_seams():
    """Where no token spans the scaffold and the arguments (one id per character), all of the
    fixed text is ids, and so is the separator between two calls."""
    scaffold = Scaffold(lambda s: [ord(c) for c in s])
    head = '<tool_call>\n{"name": "f", "arguments": '
    assert scaffold.split(head, "}\n</tool_call>") == (
        tuple(map(ord, head)),
        "",
        "",
        tuple(map(ord, "}\n</tool_call>")),
    )
    con = forced_constraint("hermes", "", TOOLS, "required", True, scaffold)
    assert con is not None
    first, more = json.loads(con.value)["format"]["elements"]
    assert more["content"]["elements"][0] == {"type": "token", "token": ord("\n")}
    assert "const_string" not in json.dumps(first)


def test_a_separator_the_tokenizer_merges_stays_text():
    # "; " between two llama3 calls: with a tokenizer that writes "}; {" as one id, the
    # separator has no ids of its own and stays text.
    def encode(s: str) -> list[int]:
        out, i = [], 0
        while i < len(s):
            if s.startswith("}; {", i):
                out.append(1000)
                i += 4
            else:
                out.append(ord(s[i]))
                i += 1
        return out

    con = forced_constraint("llama3", "", TOOLS, "required", True, Scaffold(encode))
    assert con is not None
    _, more = json.loads(con.value)["format"]["elements"]
    assert more["content"]["elements"][0] == {"type": "const_string", "value": "; "}


async def test_named_tool_choice_allows_only_that_function():
    h = await _tool_proxy("llama3")
    h.engine.sequence = [*h.tok.encode('{"name": "get_time", "parameters": {}}'), EOS]
    try:
        choice = {"type": "function", "function": {"name": "get_time"}}
        body = {
            "messages": MSG,
            "tools": TOOLS,
            "tool_choice": choice,
        }
        await h.chat(body)
        fmt = json.loads(h.engine.requests[0].constraint[1])["format"]
        # One call of the named function, though parallel_tool_calls defaults to true.
        assert _spell(h.tok, fmt)[0] == '{"name": "get_time", "parameters": '
        await _reject(
            h.stub.ChatCompletion,
            {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        )
    finally:
        await h.close()


@pytest.mark.parametrize(
    ("tools", "parallel", "most"),
    [(TOOLS[:1], True, 1), (TOOLS[:1], False, 1), (TOOLS, False, 1), (TOOLS, True, 2)],
)
def test_required_makes_at_most_one_call_per_tool_offered(tools, parallel, most):
    """Unbounded, SmolLM2-135M at temperature 0 wrote the same call 3 times under `required`,
    then hit max_tokens: after a call it prefers another to its end of turn. The constraint
    ends after one call per tool offered (one without parallel calls); after each call the
    model may end its turn."""
    con = forced_constraint("hermes", "", tools, "required", parallel, None)
    assert con is not None
    fmt = json.loads(con.value)["format"]
    calls = [fmt] if most == 1 else fmt["elements"]
    assert calls[0]["type"] == ("tag" if len(tools) == 1 else "or")
    if most > 1:  # the rest optional: the model may stop after any call
        assert calls[1]["type"] == "repeat" and (calls[1]["min"], calls[1]["max"]) == (0, most - 1)
    # Never the unbounded list of calls that looped.
    assert "tags_with_separator" not in con.value


@pytest.mark.parametrize(
    ("parser", "reasoning", "why"),
    [
        ("none", "", "no tool-call parser"),
        ("mistral", "", "cannot be enforced"),
        ("hermes", "qwen3", "reasoning"),
    ],
)
async def test_unenforceable_tool_choice_is_a_400_naming_it(parser, reasoning, why):
    h = await _tool_proxy(parser, reasoning)
    try:
        msg = await _reject(
            h.stub.ChatCompletion,
            {"messages": MSG, "tools": TOOLS, "tool_choice": "required"},
            "tool_choice",
            "unsupported_parameter",
        )
        assert why in msg
        assert h.engine.requests == []
    finally:
        await h.close()


async def test_forced_tools_and_a_response_format_cannot_both_hold_the_output():
    h = await _tool_proxy()
    try:
        body = {
            "messages": MSG,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        }
        await _reject(h.stub.ChatCompletion, body, "tool_choice")
    finally:
        await h.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_returns_the_first_call_only(stream):
    h = await _tool_proxy()
    text = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    h.engine.sequence = [*h.tok.encode(text), EOS]
    try:
        for parallel, want in ((True, 2), (False, 1)):
            body = {"messages": MSG, "tools": TOOLS, "parallel_tool_calls": parallel}
            if stream:
                chunks = await h.chat_stream(body)
                calls = {
                    tc["index"]
                    for c in chunks
                    for tc in c["choices"][0]["delta"].get("tool_calls") or []
                }
                assert len(calls) == want
            else:
                out = await h.chat(body)
                assert len(out["choices"][0]["message"]["tool_calls"]) == want
    finally:
        await h.close()


async def test_merged_choice_streams_are_bounded_by_their_reader():
    from areal_proxy.inference.choices import merged as _merged

    produced = [0, 0]

    async def endless(i):
        while True:
            produced[i] += 1
            yield b"x"

    merged = _merged([endless(0), endless(1)])
    for _ in range(3):
        await merged.__anext__()
    await asyncio.sleep(0.05)  # the producers run as far as the bound lets them
    assert sum(produced) <= 3 + 4 + 2, produced  # read + queue (2 per choice) + one in hand each
    await merged.aclose()


async def test_a_failing_choice_stream_fails_the_merged_stream():
    from areal_proxy.inference.choices import merged as _merged

    async def ok():
        yield b"a"
        await asyncio.sleep(10)
        yield b"never"

    async def broken():
        yield b"b"
        raise RuntimeError("engine went away")

    merged = _merged([ok(), broken()])
    with pytest.raises(RuntimeError, match="engine went away"):
        async for _ in merged:
            pass
