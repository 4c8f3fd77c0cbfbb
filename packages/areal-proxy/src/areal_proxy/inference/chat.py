"""`/v1/chat/completions`, whole and streamed: how a chat request reads (its output parsers)
and how its answer is written (a message, or a chunk per delta); the serving path itself is
the core's (core.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.inference.core import InferenceCore
from areal_proxy.inference.pipeline import Piece
from areal_proxy.inference.prepared import Answer, Prepared
from areal_proxy.output import openai_response as out
from areal_proxy.output.chunk_bytes import ContentChunks
from areal_proxy.output.parsing import delta_dicts, make_output_parser
from areal_runtime.openai import ChatRequest


async def whole(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> tuple[bytes, GenerationRecord]:
    req, p = await core.prelude.chat(body, env, out.response_id("chatcmpl"))
    return await core.whole(Chat(core, req, p), p)


async def stream(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> AsyncGenerator[bytes, None]:
    req, p = await core.prelude.chat(body, env, out.response_id("chatcmpl"))
    async with aclosing(core.stream(Chat(core, req, p), p)) as chunks:
        async for chunk in chunks:
            yield chunk


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


def _calls(a: Answer) -> list[dict[str, Any]] | None:
    return [out.tool_call(c.id, c.name, c.arguments) for c in a.tool_calls] or None


class Chat:
    """The chat endpoint of one request (core.Endpoint)."""

    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, core: InferenceCore, req: ChatRequest, p: Prepared) -> None:
        self.core = core
        self.req = req
        self.p = p
        self.sampling = req.sampling
        config = core.config
        self.parser = make_output_parser(
            config.tool_call_parser if req.parse_tools else "", config.reasoning_parser, req.tools
        )
        self.one_call = not req.parallel_tool_calls
        self.include_usage = req.include_usage

    def recorded(self, k: int, a: Answer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # A stream's calls keep the ids the client got (the parser events as streamed).
        return self.req.messages, assistant(a.content, a.reasoning, _calls(a))

    def choice(self, p: Prepared, k: int, a: Answer) -> dict[str, Any]:
        rec = p.recs[k][0]
        lp = (
            out.chat_logprobs(self.core.tok, rec.token_ids, rec.logprobs, rec.top_logprobs)
            if self.req.logprobs
            else None
        )
        return {
            "index": k,
            "message": out.chat_message(a.content, a.reasoning, _calls(a)),
            "logprobs": lp,
            "finish_reason": a.finish,
        }

    def stream_of(self, p: Prepared, k: int, created: int) -> ChatChunks:
        return ChatChunks(self, k, created)


class ChatChunks:
    """The chunks of one choice of a streamed chat."""

    __slots__ = ("_chat", "_content", "_created", "_first", "_index", "_model", "_usage_field")

    def __init__(self, chat: Chat, index: int, created: int) -> None:
        self._chat = chat
        self._index = index
        self._created = created
        self._model = chat.core.config.model
        self._usage_field = chat.include_usage
        self._first = True
        # A plain content delta (most of a stream) is bytes from a template made once.
        self._content = ContentChunks(
            rid=chat.p.rid,
            created=created,
            model=self._model,
            index=index,
            with_usage_field=self._usage_field,
        )

    def chunks(self, piece: Piece) -> list[bytes]:
        """A chunk per delta of the piece (the first one says the role); a step whose
        tokens made no text still carries their logprobs when asked for."""
        chat = self._chat
        if piece.events is not None:
            deltas = delta_dicts(piece.events)
        else:
            deltas = [{"content": piece.text}] if piece.text else []
        ids = piece.step.token_ids
        lp = (
            out.chat_logprobs(chat.core.tok, ids, piece.step.logprobs, piece.step.top_logprobs)
            if chat.req.logprobs and ids
            else None
        )
        if self._first:
            self._first = False
            if deltas:
                deltas[0] = {"role": "assistant", **deltas[0]}
            else:
                deltas = [{"role": "assistant", "content": ""}]
        elif not deltas and lp is not None:
            deltas = [{"content": ""}]
        sent = []
        for delta in deltas:
            if lp is None and len(delta) == 1 and "content" in delta:
                sent.append(self._content.content(delta["content"]))
                continue
            sent.append(
                orjson.dumps(
                    out.chat_chunk(
                        rid=chat.p.rid,
                        created=self._created,
                        model=self._model,
                        delta=delta,
                        logprobs=lp,
                        with_usage_field=self._usage_field,
                        index=self._index,
                    )
                )
            )
            lp = None  # the step's logprobs go with its first delta
        return sent

    def end(self, piece: Piece) -> list[bytes]:
        """The finish chunk."""
        return [
            orjson.dumps(
                out.chat_chunk(
                    rid=self._chat.p.rid,
                    created=self._created,
                    model=self._model,
                    delta={},
                    finish_reason=piece.finish_reason,
                    with_usage_field=self._usage_field,
                    index=self._index,
                )
            )
        ]
