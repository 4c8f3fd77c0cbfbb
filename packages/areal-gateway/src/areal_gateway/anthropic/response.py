"""A chat completion (whole, or its chunk stream) -> a Message (or its event stream).

What the proxy answers for the translated body (`request.py`) becomes the Message content:
`reasoning_content` a `thinking` block (signature empty: areal signs nothing), `content` a
`text` block, each of `tool_calls` a `tool_use` block (its `arguments` parsed into `input`).
The finish reason becomes `stop_reason`: stop -> end_turn (or stop_sequence, below), length
-> max_tokens, tool_calls -> tool_use, content_filter -> refusal.

A chat answer does not say which stop string ended it, only `finish_reason: stop` (as the end
of sequence token does). The generated tokens do: the proxy cuts the text at the stop string,
but the tokens (and their bytes in the logprobs, which `request.py` asks for when there are
stop sequences) run past the cut. The stop sequence that occurs first in them (the first
listed at the same place: the proxy's own rule) is the one that stopped the answer; none
there means the model ended it itself.

A request with `context_management` (accepted only when its edits remove nothing:
context_management.py) gets `context_management: {"applied_edits": []}`, on the Message and
on a stream's `message_delta`, as Anthropic answers it.

The message id is the chat completion's (`chatcmpl-<hex>` -> `msg_<hex>`), so a recorded
interaction's id names the message. A stream's `message_start` carries `input_tokens: 0`:
the prompt's size comes with the chat stream's last chunk, and `message_delta` carries it
(the SDK's accumulated message takes it from there).
"""

from __future__ import annotations

import os
from typing import Any

import orjson

# What the answer to a request with `context_management` says: no edit was applied.
NO_EDITS: dict[str, Any] = {"applied_edits": []}

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def message_id_of(chat_id: Any) -> str:
    """`msg_<hex>` for `chatcmpl-<hex>` (a proxy's random id), else a fresh one."""
    if isinstance(chat_id, str) and chat_id.startswith("chatcmpl-"):
        tail = chat_id.removeprefix("chatcmpl-")
        if len(tail) >= 16 and tail.isalnum():
            return f"msg_{tail}"
    return f"msg_{os.urandom(12).hex()}"


def usage_of(usage: Any) -> dict[str, int]:
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out = {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
    }
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        # Anthropic counts cache reads apart from input_tokens.
        cached = int(details["cached_tokens"])
        out["cache_read_input_tokens"] = cached
        out["input_tokens"] = max(0, out["input_tokens"] - cached)
    return out


def token_bytes(choice: dict[str, Any]) -> bytes:
    """The bytes of the generated tokens a choice's logprobs list."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return b""
    out = bytearray()
    for entry in lp.get("content") or ():
        raw = entry.get("bytes")
        if isinstance(raw, list):
            out.extend(raw)
        elif isinstance(entry.get("token"), str):
            out.extend(entry["token"].encode())
    return bytes(out)


def matched_stop(generated: bytes, stops: list[str]) -> str | None:
    text = generated.decode("utf-8", errors="replace")
    found, at = None, -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (at < 0 or i < at):
            found, at = s, i
    return found


def stop_of(finish: str | None, stops: list[str], generated: bytes) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish == "stop" and stops:
        hit = matched_stop(generated, stops)
        if hit is not None:
            return "stop_sequence", hit
    return STOP_REASONS.get(finish or "", "end_turn"), None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's `arguments` as the `input` object. The proxy's parsers emit JSON objects; an
    external model's arguments that are not one are kept whole under `arguments`."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        value = orjson.loads(arguments)
    except (orjson.JSONDecodeError, TypeError):
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def message(
    mid: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def whole(body: bytes, model: str, stops: list[str], context_management: bool = False) -> bytes:
    """The Message for a whole chat completion."""
    doc = orjson.loads(body)
    choice = (doc.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    calls = msg.get("tool_calls") or []
    text = msg.get("content")
    if text or not calls:
        content.append({"type": "text", "text": text or ""})
    for call in calls:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{os.urandom(12).hex()}"),
                "name": str(fn.get("name") or ""),
                "input": tool_input(fn.get("arguments")),
            }
        )
    stop = stop_of(choice.get("finish_reason"), stops, token_bytes(choice))
    out = message(message_id_of(doc.get("id")), model, content, stop, usage_of(doc.get("usage")))
    if context_management:
        out["context_management"] = NO_EDITS
    return orjson.dumps(out)


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class StreamTranslator:
    """Chat chunks in, Messages events out: message_start (and a ping), per content block
    content_block_start / _delta... / _stop, then message_delta and message_stop."""

    def __init__(self, model: str, stops: list[str], context_management: bool = False) -> None:
        self.model = model
        self.stops = stops
        self.context_management = context_management
        self.started = False
        self.finish: str | None = None
        self.usage: Any = None
        self._generated = bytearray()
        self._index = -1  # of the open content block
        self._open: str | None = None  # its kind: "thinking", "text" or "tool_use"
        self._call: tuple[int, str] | None = None  # the open tool_use's chat index and id

    def chunks(self, batch: list[bytes]) -> bytes:
        """The events for chunks that arrived together (one write)."""
        return b"".join(self.chunk(orjson.loads(raw)) for raw in batch)

    def start(self, chat_id: Any = None) -> bytes:
        self.started = True
        empty = message(message_id_of(chat_id), self.model, [], (None, None), usage_of(None))
        return event("message_start", {"message": empty}) + event("ping", {})

    def chunk(self, doc: dict[str, Any]) -> bytes:
        out = b"" if self.started else self.start(doc.get("id"))
        if doc.get("usage"):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if self.stops:
                self._generated += token_bytes(choice)
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._delta(
                    "thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                )
            if delta.get("content"):
                out += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _open_block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._index += 1
        self._open = kind
        return out + event("content_block_start", {"index": self._index, "content_block": block})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        self._call = None
        return event("content_block_stop", {"index": self._index})

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self._open != kind:
            block: dict[str, Any] = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out = self._open_block(kind, block)
        return out + event("content_block_delta", {"index": self._index, "delta": delta})

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        out = b""
        index = call.get("index", 0)
        fn = call.get("function") or {}
        cid = call.get("id")
        if self._call is None or index != self._call[0] or (cid and cid != self._call[1]):
            cid = str(cid or f"toolu_{os.urandom(12).hex()}")
            block = {"type": "tool_use", "id": cid, "name": str(fn.get("name") or ""), "input": {}}
            out = self._open_block("tool_use", block)
            self._call = (index, cid)
        args = fn.get("arguments")
        if args:
            partial = args if isinstance(args, str) else orjson.dumps(args).decode()
            out += event(
                "content_block_delta",
                {
                    "index": self._index,
                    "delta": {"type": "input_json_delta", "partial_json": partial},
                },
            )
        return out

    def end(self) -> bytes:
        """The closing events once the chat stream ended."""
        out = b"" if self.started else self.start()
        if self._index < 0:  # an empty answer is one empty text block, as a whole one
            out += self._open_block("text", {"type": "text", "text": ""})
        out += self._close_block()
        reason, sequence = stop_of(self.finish, self.stops, bytes(self._generated))
        delta: dict[str, Any] = {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_of(self.usage),
        }
        if self.context_management:
            delta["context_management"] = NO_EDITS
        out += event("message_delta", delta)
        return out + event("message_stop", {})
