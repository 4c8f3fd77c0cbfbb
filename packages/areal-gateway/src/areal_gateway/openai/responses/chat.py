"""A chat completion (whole, or its chunk stream) -> a Responses object (or its events).

What the proxy answers for the translated chat body (`request.py`) becomes the Responses
output: `reasoning_content` a reasoning item, `content` a message item (with the chat
logprobs as its `output_text` logprobs when they were asked for), each of `tool_calls` the
item of the tool the client declared under that chat name (tools.py: a `function_call`,
with `namespace` for a namespaced tool's, or a `custom_tool_call`); `finish_reason: length`
an `incomplete` response
(`max_output_tokens`); the chat usage the Responses usage. The response id is the chat
completion's (`chatcmpl-<hex>` -> `resp_<hex>`), so a recorded interaction's id names it.
"""

from __future__ import annotations

from typing import Any

import orjson

from areal_gateway.openai.responses.events import ResponseBuilder, new_id, usage_of_chat
from areal_gateway.openai.responses.tools import Tools

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id_of(chat_id: Any) -> str:
    """`resp_<hex>` for `chatcmpl-<hex>` (a proxy's random id), else a fresh one (an external
    model's id may be anything, even the same for every answer)."""
    if isinstance(chat_id, str) and chat_id.startswith("chatcmpl-"):
        tail = chat_id.removeprefix("chatcmpl-")
        if len(tail) >= 16 and tail.isalnum():
            return f"resp_{tail}"
    return new_id("resp")


def _logprobs(choice: dict[str, Any]) -> list[Any] | None:
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        content = lp.get("content")
        if isinstance(content, list):
            return content
    return None


def _begin(b: ResponseBuilder, tools: Tools, call_id: str, chat_name: str) -> bytes:
    ref = tools.ref(chat_name)
    return b.call_begin(
        call_id, ref.name, namespace=ref.namespace, custom=ref.custom, chat_name=chat_name
    )


def whole(body: bytes, b: ResponseBuilder, tools: Tools | None = None) -> bytes:
    """The Responses object for a whole chat completion."""
    tools = tools or Tools()
    doc = orjson.loads(body)
    b.id = response_id_of(doc.get("id"))
    choices = doc.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content")
    if reasoning:
        b.reasoning(reasoning)
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or not calls:
        b.text(content or "", _logprobs(choice))
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        _begin(b, tools, str(call.get("id") or new_id("call")), str(fn.get("name") or ""))
        b.call_arguments(args if isinstance(args, str) else orjson.dumps(args or {}).decode())
        b.close()
    b.finish(usage_of_chat(doc.get("usage")), _INCOMPLETE.get(choice.get("finish_reason") or ""))
    return orjson.dumps(b.response())


class StreamTranslator:
    """Chat chunks in, Responses events out (`ResponseBuilder` frames them)."""

    def __init__(self, b: ResponseBuilder, tools: Tools | None = None) -> None:
        self.b = b
        self.tools = tools or Tools()
        self.started = False
        self.finish_reason: str | None = None
        self.usage: Any = None
        # The chat index and id of the open function call.
        self._call_index: int | None = None
        self._call_id: str | None = None

    def chunks(self, batch: list[bytes]) -> bytes:
        """The events for chunks that arrived together (one write)."""
        out = b""
        for raw in batch:
            out += self.chunk(orjson.loads(raw))
        return out

    def chunk(self, doc: dict[str, Any]) -> bytes:
        b = self.b
        out = b""
        if not self.started:
            self.started = True
            b.id = response_id_of(doc.get("id"))
            out += b.start()
        usage = doc.get("usage")
        if usage:
            self.usage = usage
        for choice in doc.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content")
            if reasoning:
                out += b.reasoning(reasoning)
            content = delta.get("content")
            logprobs = _logprobs(choice)
            if content or logprobs:
                out += b.text(content or "", logprobs)
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _call(self, call: dict[str, Any]) -> bytes:
        b = self.b
        out = b""
        index = call.get("index", 0)
        fn = call.get("function") or {}
        cid = call.get("id")
        if index != self._call_index or (cid and cid != self._call_id):
            self._call_index = index
            self._call_id = str(cid or new_id("call"))
            out += _begin(b, self.tools, self._call_id, str(fn.get("name") or ""))
        args = fn.get("arguments")
        if args:
            out += b.call_arguments(args if isinstance(args, str) else orjson.dumps(args).decode())
        return out

    def end(self) -> bytes:
        """The closing events once the chat stream ended."""
        b = self.b
        out = b""
        if not self.started:
            self.started = True
            out += b.start()
        if not b.items:
            out += b.text("")  # an empty answer is an empty message, as a whole one
        return out + b.finish(usage_of_chat(self.usage), _INCOMPLETE.get(self.finish_reason or ""))
