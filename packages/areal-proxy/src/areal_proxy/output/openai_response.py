"""OpenAI response bodies and stream chunks (dicts; the caller serializes with orjson)."""

from __future__ import annotations

import os
from typing import Any

from areal_proxy.common.tokenizer import ModelTokenizer

TopLogprobs = list[list[tuple[int, float]]]


def response_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _entry(tok: ModelTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    b = tok.token_bytes(token_id)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(
    tok: ModelTokenizer, ids: list[int], lps: list[float], tops: TopLogprobs
) -> dict[str, Any]:
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        e = _entry(tok, tid, lp)
        top = tops[i] if i < len(tops) else []
        e["top_logprobs"] = [_entry(tok, t, tlp) for t, tlp in top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tok: ModelTokenizer,
    ids: list[int],
    lps: list[float],
    tops: TopLogprobs,
    *,
    with_top: bool,
    offset: int,
) -> dict[str, Any]:
    tokens = [tok.token_text(t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top_out: list[dict[str, float] | None] | None = None
    if with_top:
        top_out = []
        for i in range(len(ids)):
            top = tops[i] if i < len(tops) else []
            top_out.append({tok.token_text(t): lp for t, lp in top})
    return {
        "tokens": tokens,
        "token_logprobs": list(lps),
        "top_logprobs": top_out,
        "text_offset": offsets,
    }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_message(
    content: str | None,
    reasoning_content: str | None,
    tool_calls: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def whole_response(
    *,
    obj: str,
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, int],
) -> dict[str, Any]:
    """A non-streamed answer: `obj` "chat.completion" (choices: index, message, logprobs,
    finish_reason) or "text_completion" (choices: index, text, logprobs, finish_reason)."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_chunk(
    *,
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    *,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    *, rid: str, created: int, model: str, obj: str, usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }
