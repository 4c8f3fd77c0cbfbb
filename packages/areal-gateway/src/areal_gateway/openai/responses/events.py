"""Responses API objects and stream events, built one output item at a time.

The one implementation of the Responses shapes, used by the inference gateway (a chat
completion or its chunk stream translated, `chat_to_responses.py`) and by the agent gateway
(agent events, `agent/shapes.py`). A `ResponseBuilder` holds the response being built: each
method adds to its output and returns the stream events that addition makes (the official
SDK's types: `response.output_item.added`, `response.output_text.delta`, ...), numbered in
order, framed as SSE (`event: <type>` + `data: <json>`). A non-streamed response uses the same
methods with `stream=False` (no events are serialized) and `whole()`.

Output items: `message` (text in one `output_text` part, with logprobs when asked for),
`reasoning` (the model's reasoning text as one `reasoning_text` content part; its summary
is empty, or, when the request asked for one, that same text as one `summary_text` part:
areal has no summarizer, and the whole reasoning is the truest summary it can give; with
`encrypted_content: null` when the request asked to include it), `function_call`
(arguments streamed as they come; `namespace` for a namespaced tool's), `custom_tool_call`
(its `input` taken from the chat call's arguments once they are whole, so its input events
come at its end), and complete items added as they are (`function_call_output`, which only
an agent runs).
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from areal_gateway.openai.responses.tools import custom_input

ZERO_USAGE: dict[str, Any] = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}

# What a response echoes of its request when the caller gives nothing (the agent gateway).
DEFAULT_ECHO: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "text": {"format": {"type": "text"}},
    "temperature": None,
    "top_p": None,
    "truncation": "disabled",
    "reasoning": {"effort": None, "summary": None},
    "store": True,
    "background": False,
    "user": None,
    "top_logprobs": None,
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def usage_of_chat(usage: Any) -> dict[str, Any]:
    """A chat completion's `usage` as the Responses API counts it."""
    if not isinstance(usage, dict):
        return ZERO_USAGE
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    pd = usage.get("prompt_tokens_details")
    cd = usage.get("completion_tokens_details")
    cached = int(pd.get("cached_tokens") or 0) if isinstance(pd, dict) else 0
    reasoning = int(cd.get("reasoning_tokens") or 0) if isinstance(cd, dict) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


class ResponseBuilder:
    """One response under construction (see the module docstring)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        *,
        echo: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        previous_response_id: str | None = None,
        stream: bool = True,
        created_at: int | None = None,
        summary: bool = False,
        encrypted_content: bool = False,
    ) -> None:
        self.id = response_id
        self.model = model
        self.echo = {**DEFAULT_ECHO, **(echo or {})}
        self.metadata = metadata if metadata is not None else {}
        self.previous_response_id = previous_response_id
        self.stream = stream
        self.created_at = created_at if created_at is not None else int(time.time())
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self._seq = 0
        # The item being streamed: its kind ("message", "reasoning", "call"), the item,
        # and its text so far (list of pieces) and logprobs.
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []
        self._logprobs: list[Any] = []
        self.summary = summary
        self.encrypted_content = encrypted_content
        # Item id -> (chat function name, arguments) of each call, as the model produced it
        # (a namespaced or custom tool's item names it otherwise).
        self.chat_calls: dict[str, tuple[str, str]] = {}

    # -- framing --
    def ev(self, type_: str, **fields: Any) -> bytes:
        if not self.stream:
            return b""
        data = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        done = self.status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": self.items if done else [],
            "usage": (self.usage or ZERO_USAGE) if done else None,
            "metadata": self.metadata,
            "previous_response_id": self.previous_response_id,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            **self.echo,
        }

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    # -- the response's life --
    def start(self) -> bytes:
        r = self.response()
        return self.ev("response.created", response=r) + self.ev("response.in_progress", response=r)

    def finish(
        self, usage: dict[str, Any] | None = None, incomplete_reason: str | None = None
    ) -> bytes:
        out = self.close()
        self.usage = usage or ZERO_USAGE
        if incomplete_reason:
            self.status = "incomplete"
            self.incomplete_details = {"reason": incomplete_reason}
            return out + self.ev("response.incomplete", response=self.response())
        self.status = "completed"
        return out + self.ev("response.completed", response=self.response())

    def fail(self, code: str, message: str, param: str | None = None) -> bytes:
        out = self.close()
        self.status = "failed"
        self.error = {"code": code, "message": message}
        out += self.ev("error", code=code, message=message, param=param)
        return out + self.ev("response.failed", response=self.response())

    def whole(self) -> bytes:
        if self.status == "in_progress":
            self.finish(self.usage)
        return orjson.dumps(self.response())

    # -- items --
    def _add(self, item: dict[str, Any], kind: str) -> bytes:
        out = self.close()
        self.items.append(item)
        self._open = {"kind": kind, "item": item}
        self._pieces = []
        self._logprobs = []
        return out + self.ev("response.output_item.added", output_index=self._index, item=item)

    def text(self, delta: str, logprobs: list[Any] | None = None) -> bytes:
        """More text of the assistant's message (a new message item when none is open)."""
        out = b""
        if self._open is None or self._open["kind"] != "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            out += self._add(item, "message")
            out += self.ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self._pieces.append(delta)
        if logprobs:
            self._logprobs.extend(logprobs)
        if not self.stream:
            return out
        return out + self.ev(
            "response.output_text.delta",
            item_id=self._open["item"]["id"],  # type: ignore[index]
            output_index=self._index,
            content_index=0,
            delta=delta,
            logprobs=logprobs or [],
        )

    def reasoning(self, delta: str) -> bytes:
        """More of the model's reasoning (a new reasoning item when none is open)."""
        out = b""
        if self._open is None or self._open["kind"] != "reasoning":
            item: dict[str, Any] = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            if self.encrypted_content:
                item["encrypted_content"] = None
            out += self._add(item, "reasoning")
            if self.summary:
                out += self.ev(
                    "response.reasoning_summary_part.added",
                    item_id=item["id"],
                    output_index=self._index,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
        self._pieces.append(delta)
        item_id = self._open["item"]["id"]  # type: ignore[index]
        out += self.ev(
            "response.reasoning_text.delta",
            item_id=item_id,
            output_index=self._index,
            content_index=0,
            delta=delta,
        )
        if self.summary:
            out += self.ev(
                "response.reasoning_summary_text.delta",
                item_id=item_id,
                output_index=self._index,
                summary_index=0,
                delta=delta,
            )
        return out

    def call_begin(
        self,
        call_id: str,
        name: str,
        *,
        namespace: str | None = None,
        custom: bool = False,
        chat_name: str | None = None,
    ) -> bytes:
        """A tool call starts; its arguments follow through `call_arguments`. `name` and
        `namespace` as the client declared the tool; `chat_name` the chat function the model
        called (`name` when not given); `custom`: a custom tool's call."""
        item: dict[str, Any]
        if custom:
            item = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": call_id}
        else:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id}
        item["name"] = name
        if namespace is not None:
            item["namespace"] = namespace
        if custom:
            item["input"] = ""
        else:
            item["arguments"] = ""
            item["status"] = "in_progress"
        self.chat_calls[item["id"]] = (chat_name or name, "")
        return self._add(item, "custom" if custom else "call")

    def call_arguments(self, delta: str) -> bytes:
        if self._open is None or self._open["kind"] not in ("call", "custom") or not delta:
            return b""
        self._pieces.append(delta)
        if self._open["kind"] == "custom":
            return b""  # the input is known once the arguments are whole (close)
        return self.ev(
            "response.function_call_arguments.delta",
            item_id=self._open["item"]["id"],
            output_index=self._index,
            delta=delta,
        )

    def call(
        self,
        call_id: str,
        name: str,
        arguments: str,
        *,
        namespace: str | None = None,
        custom: bool = False,
        chat_name: str | None = None,
    ) -> bytes:
        """A whole tool call."""
        return (
            self.call_begin(call_id, name, namespace=namespace, custom=custom, chat_name=chat_name)
            + self.call_arguments(arguments)
            + self.close()
        )

    def item(self, item: dict[str, Any]) -> bytes:
        """A complete item as it is (added and done at once)."""
        out = self.close()
        self.items.append(item)
        return (
            out
            + self.ev("response.output_item.added", output_index=self._index, item=item)
            + self.ev("response.output_item.done", output_index=self._index, item=item)
        )

    def close(self) -> bytes:
        """Finish the open item, if any: its done events, its final shape."""
        open_ = self._open
        if open_ is None:
            return b""
        self._open = None
        item, kind, idx = open_["item"], open_["kind"], self._index
        text = "".join(self._pieces)
        self._pieces = []
        if kind != "custom":  # a custom tool call has no status
            item["status"] = "completed"
        out = b""
        if kind == "message":
            logprobs, self._logprobs = self._logprobs, []
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            item["content"] = [part]
            out += self.ev(
                "response.output_text.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                text=text,
                logprobs=logprobs,
            )
            out += self.ev(
                "response.content_part.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                part=part,
            )
        elif kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out += self.ev(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                text=text,
            )
            if self.summary:
                part = {"type": "summary_text", "text": text}
                item["summary"] = [part]
                out += self.ev(
                    "response.reasoning_summary_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    text=text,
                )
                out += self.ev(
                    "response.reasoning_summary_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    part=part,
                )
        elif kind == "custom":
            item["input"] = custom_input(text)
            self.chat_calls[item["id"]] = (self.chat_calls[item["id"]][0], text)
            out += self.ev(
                "response.custom_tool_call_input.delta",
                item_id=item["id"],
                output_index=idx,
                delta=item["input"],
            )
            out += self.ev(
                "response.custom_tool_call_input.done",
                item_id=item["id"],
                output_index=idx,
                input=item["input"],
            )
        else:
            item["arguments"] = text
            self.chat_calls[item["id"]] = (self.chat_calls[item["id"]][0], text)
            out += self.ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                name=item["name"],
                arguments=text,
            )
        return out + self.ev("response.output_item.done", output_index=idx, item=item)
