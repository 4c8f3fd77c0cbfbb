"""`/v1/chat/completions`, whole and streamed, over the prompt-and-record core."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy import openai_response as out
from areal_proxy.chunk_bytes import ContentChunks
from areal_proxy.generation import GenerationRecord
from areal_proxy.inference.core import InferenceCore, Prepared, usage
from areal_proxy.output_parsing import (
    collect_events,
    delta_dicts,
    first_call_only,
    make_output_parser,
)
from areal_proxy.recorder import OpenTurn
from areal_runtime.openai import ChatRequest


def _output_parser(core: InferenceCore, req: ChatRequest) -> Any | None:
    return make_output_parser(
        core.config.tool_call_parser if req.parse_tools else "",
        core.config.reasoning_parser,
        req.tools,
    )


def assistant(
    content: str | None, reasoning: str | None, calls: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The assistant message as recorded (and as the client will echo it back)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


async def whole(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> tuple[bytes, GenerationRecord]:
    req, p = await core.prepare_chat(body, env, out.response_id("chatcmpl"))
    try:
        await core.generate_all(p)
    finally:
        core.finish(p)
    finals = [core.final_text(rec, p.template, req.sampling) for rec, _ in p.recs]
    for text, finish in finals:  # every choice checked before any is recorded
        core.check_json(p, text, finish)
    choices = []
    for i, (rec, _) in enumerate(p.recs):
        text, finish = finals[i]
        content: str | None = text
        reasoning: str | None = None
        calls: list[dict[str, Any]] | None = None
        counts = (0, 0)
        parser = _output_parser(core, req)
        if parser is not None:
            parsed = parser.parse(text)
            content, reasoning = parsed.content, parsed.reasoning_content
            counts = (parsed.calls_made, len(parsed.tool_calls))
            calls = [out.tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls] or None
            if calls and not req.parallel_tool_calls:
                calls = calls[:1]
            if calls and finish == "stop":
                finish = "tool_calls"
        lp = (
            out.chat_logprobs(core.tok, rec.token_ids, rec.logprobs, rec.top_logprobs)
            if req.logprobs
            else None
        )
        await core.commit(
            p.turn_of(i),
            req.messages,
            assistant(content, reasoning, calls),
            rec,
            finish,
            tool_calls=counts,
        )
        choices.append(
            {
                "index": i,
                "message": out.chat_message(content, reasoning, calls),
                "logprobs": lp,
                "finish_reason": finish,
            }
        )
    body_out = out.whole_response(
        obj="chat.completion",
        rid=p.rid,
        created=int(time.time()),
        model=core.config.model,
        choices=choices,
        usage_=usage(p.recs),
    )
    return orjson.dumps(body_out), p.recs[0][0]


async def stream(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> AsyncGenerator[bytes, None]:
    req, p = await core.prepare_chat(body, env, out.response_id("chatcmpl"))
    created = int(time.time())
    streams = [
        _choice_stream(core, req, p, rec, p.turn_of(i), created, i)
        for i, (rec, _) in enumerate(p.recs)
    ]
    obj = "chat.completion.chunk"
    async with aclosing(core.stream_choices(p, streams, created, obj, req.include_usage)) as s:
        async for chunk in s:
            yield chunk


async def _choice_stream(
    core: InferenceCore,
    req: ChatRequest,
    p: Prepared,
    rec: GenerationRecord,
    ot: OpenTurn | None,
    created: int,
    index: int,
) -> AsyncGenerator[bytes, None]:
    """The chunks of one choice of a streamed chat."""
    parser = _output_parser(core, req)
    streamer = parser.streamer() if parser is not None else None
    model = core.config.model
    texts: list[str] = []
    # The parser events as streamed, so the recorded message has the tool call ids the
    # client got (parsing the text again would mint new ones).
    events: list[Any] = []
    usage_field = req.include_usage
    first = True
    content_chunks = ContentChunks(
        rid=p.rid, created=created, model=model, index=index, with_usage_field=usage_field
    )
    async with aclosing(core.text_steps(p, rec, 0, req.sampling)) as steps:
        async for ts in steps:
            if ot is not None or p.schema is not None:
                texts.append(ts.text)
            if streamer is not None:
                raw = streamer.feed(ts.text) if ts.text else []
                if ts.finish_reason is not None:
                    raw.extend(streamer.finish())
                if not req.parallel_tool_calls:
                    raw = first_call_only(raw)
                if ot is not None:
                    events.extend(raw)
                deltas = delta_dicts(raw)
            else:
                deltas = [{"content": ts.text}] if ts.text else []
            ids = ts.step.token_ids
            lp = (
                out.chat_logprobs(core.tok, ids, ts.step.logprobs, ts.step.top_logprobs)
                if req.logprobs and ids
                else None
            )
            if first:
                first = False
                if deltas:
                    deltas[0] = {"role": "assistant", **deltas[0]}
                else:
                    deltas = [{"role": "assistant", "content": ""}]
            elif not deltas and lp is not None:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                if (lp is None or i > 0) and len(delta) == 1 and "content" in delta:
                    yield content_chunks.content(delta["content"])
                    continue
                yield orjson.dumps(
                    out.chat_chunk(
                        rid=p.rid,
                        created=created,
                        model=model,
                        delta=delta,
                        logprobs=lp if i == 0 else None,
                        with_usage_field=usage_field,
                        index=index,
                    )
                )
            if ts.finish_reason is not None:
                finish = ts.finish_reason
                core.check_json(p, "".join(texts), finish)
                if finish == "stop" and streamer is not None and streamer.saw_tool_calls:
                    finish = "tool_calls"
                if ot is not None:
                    # Committed before the client sees the end: acknowledged = durable.
                    await core.commit(
                        ot,
                        req.messages,
                        _streamed(texts, events, streamer),
                        rec,
                        finish,
                        tool_calls=streamer.call_counts if streamer is not None else (0, 0),
                    )
                yield orjson.dumps(
                    out.chat_chunk(
                        rid=p.rid,
                        created=created,
                        model=model,
                        delta={},
                        finish_reason=finish,
                        with_usage_field=usage_field,
                        index=index,
                    )
                )


def _streamed(texts: list[str], events: list[Any], streamer: Any) -> dict[str, Any]:
    """The assistant message a stream sent: its parsed parts, as the client got them."""
    if streamer is None:
        return assistant("".join(texts), None, None)
    parsed = collect_events(events)
    calls = [out.tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls] or None
    return assistant(parsed.content, parsed.reasoning_content, calls)
