"""Long sessions through the real ProxyServer (gRPC on loopback): a turn that extends the
previous one continues its prompt, the engine gets exactly the full path's ids, and every
other case falls back visibly and still answers right."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, start

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.prompt.chat_template import PromptBuilder
from areal_proxy.prompt.incremental import FALLBACK_REASONS
from areal_runtime.session_keys import mint_key, new_id

ANSWER = [7, 8, 9, EOS]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


class TurnEngine(FakeEngineClient):
    """The same answer to every request (each a new turn, not a resubmission); checks that
    the ids encoded ahead for the engine's JSON are the request's ids."""

    encoded = 0

    async def generate_stream(self, req):  # type: ignore[no-untyped-def]
        if req.input_ids_json is not None:
            assert orjson.loads(req.input_ids_json) == req.input_ids
            self.encoded += 1
        self._prompt_len = None
        async for chunk in super().generate_stream(req):
            yield chunk


async def _session(h) -> tuple[str, str]:
    sid = new_id("sess")
    key = mint_key(sid)
    await h.stub.StartSessions(
        proxy_pb2.StartSessionsRequest(
            task_id="t",
            group_id=new_id("g"),
            sessions=[proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)],
        )
    )
    return sid, key


def _user(i: int) -> dict[str, Any]:
    return {"role": "user", "content": f"question {i}: " + "words and more words " * (i % 7 + 1)}


def _tool_turn(i: int) -> list[dict[str, Any]]:
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"q": i})},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i} ünï 🙂"},
    ]


def _paths(h) -> dict[str, float]:
    m = h.server.metrics
    out = {p: m.prompt_builds.labels(p)._value.get() for p in ("incremental", "full")}
    for reason in FALLBACK_REASONS:
        out[reason] = m.prompt_fallbacks.labels(reason)._value.get()
    return out


async def _turns(h, sid, key, n, *, tools=None, start_msgs=None):
    """n turns of one conversation, each echoing the answer and adding a user message (and
    every third turn a tool call and its result); returns the messages of each turn."""
    msgs = list(start_msgs or [{"role": "system", "content": "You are terse."}])
    sent = []
    for i in range(n):
        if i % 3 == 2:
            msgs.extend(_tool_turn(i))
        msgs.append(_user(i))
        body: dict[str, Any] = {"messages": msgs, "max_tokens": 8}
        if tools:
            body["tools"] = tools
        r = await h.chat(body, api_key=key, session_id=sid)
        sent.append(list(msgs))
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return sent, msgs


def _full(h, msgs, tools=None) -> list[int]:
    return h.tok.encode(PromptBuilder(h.tok).render(msgs, tools))


@pytest.mark.parametrize("tools", [None, TOOLS])
async def test_hf_turns_send_exactly_the_whole_tokenization(tools):
    h = await start(TurnEngine(ANSWER), chat_template_type="hf")
    try:
        sid, key = await _session(h)
        sent, _ = await _turns(h, sid, key, 12, tools=tools)
        assert [r.input_ids for r in h.engine.requests] == [_full(h, m, tools) for m in sent]
        assert _paths(h)["incremental"] == 11 and _paths(h)["full"] == 1
        assert h.engine.encoded == 11, "a continued prompt's ids go to the engine encoded"
        paths = h.server.store.prompt_paths(sid)
        assert paths == {"full": 1, "incremental": 11}
        # The recording holds what was sent.
        rows = h.server.store.interactions(sid)
        assert [r.prompt_ids for r in rows] == [r.input_ids for r in h.engine.requests]
    finally:
        await h.close()


async def test_concat_turns_continue_the_exact_previous_ids():
    h = await start(TurnEngine(ANSWER))  # concat: the default
    try:
        sid, key = await _session(h)
        sent, _ = await _turns(h, sid, key, 10)
        reqs = h.engine.requests
        builder = PromptBuilder(h.tok)
        for i in range(1, len(sent)):
            previous = [*reqs[i - 1].input_ids, *ANSWER]
            assert reqs[i].input_ids[: len(previous)] == previous
            # Then what the template writes after the answer's <|im_end|>: the rest of the
            # conversation's rendering, from the newline that follows it.
            answered = [*sent[i - 1], {"role": "assistant", "content": h.tok.decode(ANSWER)}]
            head = builder.template.render(answered, add_generation_prompt=False)
            rendered = builder.render(sent[i])
            assert head.endswith("<|im_end|>\n") and rendered.startswith(head)
            new = h.tok.encode("<|im_end|>" + rendered[len(head) - 1 :])[1:]
            assert reqs[i].input_ids == previous + new
        assert _paths(h)["incremental"] == 9
        rows = h.server.store.interactions(sid)
        assert all(r.inherited == len(rows[i - 1].prompt_ids) + 4 for i, r in enumerate(rows) if i)
    finally:
        await h.close()


async def test_concat_new_chains_are_named_and_continued_ones_keep_their_ids():
    h = await start(TurnEngine(ANSWER))
    try:
        sid, key = await _session(h)
        _sent, msgs = await _turns(h, sid, key, 3)

        async def send(messages, tools=None):
            body: dict[str, Any] = {"messages": messages, "max_tokens": 8}
            if tools:
                body["tools"] = tools
            await h.chat(body, api_key=key, session_id=sid)
            return h.engine.requests[-1].input_ids

        last = h.server.store.interactions(sid)[-1]
        sampled = last.prompt_ids + last.output_ids
        # An earlier message edited: its answers extend no recorded turn; a new chain.
        edited = [dict(m) for m in msgs] + [_user(10)]
        edited[1] = {"role": "user", "content": "something else"}
        assert await send(edited) == _full(h, edited)
        # A side call (a title, say): a conversation of its own, with no earlier answer.
        title = [{"role": "system", "content": "Write a title."}, _user(11)]
        assert await send(title) == _full(h, title)
        # Tools the template renders, sent for the first time mid-session: the lineage
        # matches (it ignores tools), the rendering of the old part does not; the ids the
        # model saw and sampled stay, the new messages follow.
        ids = await send([*msgs, _user(12)], TOOLS)
        assert ids[: len(sampled)] == sampled
        paths = h.server.store.prompt_paths(sid)
        assert paths == {
            "full": 1,
            "incremental": 2,
            "full:history_edited": 1,
            "full:new_conversation": 1,
            "full:render_changed": 1,
        }
        rows = h.server.store.interactions(sid)
        assert [r.parent_id is None for r in rows[-3:]] == [True, True, False]
        assert [r.inherited for r in rows[-3:]] == [0, 0, len(sampled)]
        assert _paths(h)["new_conversation"] == 1
    finally:
        await h.close()


async def test_concat_tool_calls_echoed_as_compact_json_continue():
    """A JavaScript harness sends the answer's tool call back with its arguments parsed
    and written again compactly: the lineage matches it by meaning, and the next turn
    continues the sampled ids from the cached prompt."""
    call_text = '<tool_call>\n{"name": "lookup", "arguments": {"q": 1, "deep": true}}\n</tool_call>'
    h0 = await start(TurnEngine(ANSWER))
    ids = [*h0.tok.encode(call_text), EOS]
    await h0.close()
    h = await start(TurnEngine(ids), tool_call_parser="hermes")
    try:
        sid, key = await _session(h)
        msgs: list[dict[str, Any]] = [_user(0)]
        body = {"messages": msgs, "max_tokens": 64, "tools": TOOLS}
        r = await h.chat(body, api_key=key, session_id=sid)
        message = r["choices"][0]["message"]
        [call] = message["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert args == {"q": 1, "deep": True}
        compact = json.dumps(dict(reversed(args.items())), separators=(",", ":"))
        echo = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "id": "call_mine", "function": {**call["function"], "arguments": compact}}
            ],
        }
        msgs = [*msgs, echo, {"role": "tool", "tool_call_id": "call_mine", "content": "found"}]
        await h.chat({**body, "messages": msgs}, api_key=key, session_id=sid)
        first, second = h.server.store.interactions(sid)
        sampled = first.prompt_ids + first.output_ids
        assert second.parent_id == first.interaction_id and second.inherited == len(sampled)
        assert second.prompt_ids[: len(sampled)] == sampled
        assert second.prompt_path == "incremental"
    finally:
        await h.close()


async def test_hf_fallbacks_answer_right_and_are_counted():
    h = await start(TurnEngine(ANSWER), chat_template_type="hf")
    try:
        sid, key = await _session(h)
        _sent, msgs = await _turns(h, sid, key, 3)

        async def send(messages, tools=None):
            body: dict[str, Any] = {"messages": messages, "max_tokens": 8}
            if tools:
                body["tools"] = tools
            await h.chat(body, api_key=key, session_id=sid)
            assert h.engine.requests[-1].input_ids == _full(h, messages, tools)

        # An earlier message edited: the messages extend no recorded turn.
        edited = [dict(m) for m in msgs] + [_user(10)]
        edited[1] = {"role": "user", "content": "something else"}
        await send(edited)
        assert _paths(h)["history_edited"] == 1
        # A new system prompt: likewise.
        await send([{"role": "system", "content": "Be verbose."}, *msgs[1:], _user(11)])
        assert _paths(h)["history_edited"] == 2
        # Tools the template renders, sent for the first time mid-session: the lineage still
        # matches (it ignores tools), the rendering of the old part does not.
        await send([*msgs, _user(12)], TOOLS)
        assert _paths(h)["render_changed"] == 1
        paths = h.server.store.prompt_paths(sid)
        assert paths["full:history_edited"] == 2 and paths["full:render_changed"] == 1
    finally:
        await h.close()


async def test_a_session_evicted_from_the_cache_falls_back_then_continues():
    h = await start(TurnEngine(ANSWER), prompt_cache_mb=1, context_length=1_000_000)
    try:
        a = await _session(h)
        b = await _session(h)
        _sent_a, msgs_a = await _turns(h, *a, 2)
        # b's turns fill the cache past 1 MiB: a, least recently used, is evicted.
        big = [{"role": "system", "content": "x " * 300_000}]
        await _turns(h, *b, 2, start_msgs=big)
        assert h.server.book.turns.latest(a[0]) is None
        msgs_a.append(_user(5))
        await h.chat({"messages": msgs_a, "max_tokens": 8}, api_key=a[1], session_id=a[0])
        assert h.engine.requests[-1].input_ids == _full(h, msgs_a)
        assert _paths(h)["not_cached"] == 1
        assert h.server.store.prompt_paths(a[0])["full:not_cached"] == 1
    finally:
        await h.close()


async def test_a_restarted_proxy_continues_the_session(tmp_path):
    db = str(tmp_path / "proxy.db")
    h = await start(TurnEngine(ANSWER), db_path=db)
    try:
        sid, key = await _session(h)
        _, msgs = await _turns(h, sid, key, 3)
    finally:
        await h.close()
    h = await start(TurnEngine(ANSWER), db_path=db)
    try:
        for i in range(2):
            msgs.append(_user(20 + i))
            r = await h.chat({"messages": msgs, "max_tokens": 8}, api_key=key, session_id=sid)
            assert h.engine.requests[-1].input_ids == _full(h, msgs)
            msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        assert h.server.store.prompt_paths(sid) == {
            "full": 1,
            "incremental": 3,
            "full:not_cached": 1,
        }
        rows = h.server.store.interactions(sid)
        assert [r.parent_id for r in rows][1:] == [r.interaction_id for r in rows][:-1]
    finally:
        await h.close()


async def test_two_turns_of_one_session_in_flight_at_once():
    h = await start(TurnEngine(ANSWER, delay=0.05))
    try:
        sid, key = await _session(h)
        _, msgs = await _turns(h, sid, key, 2)
        # A harness running two tool calls side by side: two requests extend the same turn.
        branches = [[*msgs, _user(30)], [*msgs, *_tool_turn(31), _user(31)]]
        await asyncio.gather(
            *(
                h.chat({"messages": m, "max_tokens": 8}, api_key=key, session_id=sid)
                for m in branches
            )
        )
        got = sorted(r.input_ids for r in h.engine.requests[-2:])
        assert got == sorted(_full(h, m) for m in branches)
        assert h.server.store.prompt_paths(sid)["incremental"] == 3
    finally:
        await h.close()


async def test_stream_and_choices_continue_too():
    h = await start(TurnEngine(ANSWER))
    try:
        sid, key = await _session(h)
        msgs = [_user(0)]
        await h.chat_stream({"messages": msgs, "max_tokens": 8}, api_key=key, session_id=sid)
        msgs += [{"role": "assistant", "content": h.tok.decode(ANSWER)}, _user(1)]
        r = await h.chat({"messages": msgs, "max_tokens": 8, "n": 2}, api_key=key, session_id=sid)
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert h.engine.requests[-1].input_ids == _full(h, msgs)
        msgs += [{"role": "assistant", "content": r["choices"][1]["message"]["content"]}]
        msgs.append(_user(2))
        await h.chat_stream({"messages": msgs, "max_tokens": 8}, api_key=key, session_id=sid)
        assert h.engine.requests[-1].input_ids == _full(h, msgs)
        assert h.server.store.prompt_paths(sid) == {"full": 1, "incremental": 3}
    finally:
        await h.close()


async def test_hf_answers_and_tool_calls_echoed_differently_answer_right():
    h = await start(TurnEngine(ANSWER), chat_template_type="hf")
    try:
        sid, key = await _session(h)
        _, msgs = await _turns(h, sid, key, 3)  # turn 3 carries a tool call and its result

        async def send(messages):
            await h.chat({"messages": messages, "max_tokens": 8}, api_key=key, session_id=sid)
            assert h.engine.requests[-1].input_ids == _full(h, messages)

        # The tool call echoed with another id: the lineage ignores call ids and the template
        # does not render them, so the turn continues (and is right).
        calls = [i for i, m in enumerate(msgs) if m.get("tool_calls")]
        echoed = [dict(m) for m in msgs]
        call = dict(echoed[calls[0]]["tool_calls"][0], id="call_other")
        echoed[calls[0]] = {**echoed[calls[0]], "tool_calls": [call]}
        await send([*echoed, _user(40)])
        assert h.server.store.prompt_paths(sid)["incremental"] == 3
        # Its arguments re-serialized (other spacing): the same call by meaning, so the turn
        # still extends turn 3. The last answer echoed with other text: the longest recorded
        # conversation the messages still extend is turn 2's; right, and not whole.
        fn = dict(call["function"], arguments=call["function"]["arguments"].replace(" ", ""))
        echoed[calls[0]] = {**echoed[calls[0]], "tool_calls": [dict(call, function=fn)]}
        await send([*echoed, _user(41)])
        await send([*msgs[:-1], {"role": "assistant", "content": "not what I said"}, _user(42)])
        rows = h.server.store.interactions(sid)
        assert [r.parent_id for r in rows[-2:]] == [rows[2].interaction_id, rows[1].interaction_id]
        # The first of these extends turn 3, whose rendering (hf renders the arguments as
        # sent) changed: the full path. By the second, turn 2 was four turns back, past the
        # few a session keeps cached: the full path, and still right.
        assert h.server.store.prompt_paths(sid) == {
            "full": 1,
            "incremental": 3,
            "full:render_changed": 1,
            "full:not_cached": 1,
        }
    finally:
        await h.close()
