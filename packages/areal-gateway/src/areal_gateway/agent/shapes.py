"""Agent events -> OpenAI shapes: the Responses API and chat completions.

An agent turn is a sequence of events (`delta`, `tool_call`, `tool_result`, `done`, `error`).
A shape turns each event into the frames a streaming client gets at once, and keeps what the
non-streamed answer needs. Both shapes see the same events in the same order.

Responses: text deltas fill a `message` output item (a new one after each tool event); a tool
call is a `function_call` item; a tool result a `function_call_output` item (the agent ran the
tool itself). Chat: the agent is a model; only its text reaches the client.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from areal_gateway.openai.errors import error_body
from areal_gateway.openai.sse import DONE, frame
from areal_runtime.errors import AgentError, ServiceError

ZERO_USAGE_RESPONSES = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}


def agent_error(data: dict[str, Any]) -> ServiceError:
    message = str(data.get("message") or "the agent failed")
    return AgentError(message)


def response_id(session_id: str) -> str:
    """`resp_<hex>_<session id>`: a later `previous_response_id` names its session."""
    return f"resp_{os.urandom(8).hex()}_{session_id}"


def session_of_response(rid: str) -> str | None:
    if not rid.startswith("resp_"):
        return None
    _, _, rest = rid.partition("_")
    _, sep, sid = rest.partition("_")
    return sid if sep and sid else None


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


class ResponsesShape:
    def __init__(
        self,
        session_id: str,
        model: str,
        metadata: dict[str, Any],
        previous_response_id: str | None,
    ) -> None:
        self.id = response_id(session_id)
        self.model = model
        self.metadata = metadata
        self.previous_response_id = previous_response_id
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self._text: dict[str, Any] | None = None  # the open message item
        self._parts: list[str] = []
        self._seq = 0

    # -- frames --
    def _ev(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self.items if status != "in_progress" else [],
            "usage": ZERO_USAGE_RESPONSES if status != "in_progress" else None,
            "metadata": self.metadata,
            "previous_response_id": self.previous_response_id,
            "error": error,
            "incomplete_details": None,
            "instructions": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "temperature": None,
            "top_p": None,
        }

    def start(self) -> bytes:
        r = self.response("in_progress")
        return self._ev("response.created", response=r) + self._ev(
            "response.in_progress", response=r
        )

    def _close_text(self) -> bytes:
        item = self._text
        if item is None:
            return b""
        self._text = None
        text = "".join(self._parts)
        self._parts = []
        part = {"type": "output_text", "text": text, "annotations": []}
        item["content"] = [part]
        item["status"] = "completed"
        idx = len(self.items) - 1
        return (
            self._ev(
                "response.output_text.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + self._ev(
                "response.content_part.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                part=part,
            )
            + self._ev("response.output_item.done", output_index=idx, item=item)
        )

    def event(self, typ: str, data: dict[str, Any]) -> bytes:
        if typ == "delta":
            text = str(data.get("text", ""))
            out = b""
            if self._text is None:
                self._text = {
                    "id": f"msg_{os.urandom(8).hex()}",
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                self.items.append(self._text)
                idx = len(self.items) - 1
                out += self._ev("response.output_item.added", output_index=idx, item=self._text)
                out += self._ev(
                    "response.content_part.added",
                    item_id=self._text["id"],
                    output_index=idx,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            self._parts.append(text)
            return out + self._ev(
                "response.output_text.delta",
                item_id=self._text["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        if typ == "tool_call":
            out = self._close_text()
            args = _json_text(data.get("arguments", {}))
            item = {
                "id": f"fc_{os.urandom(8).hex()}",
                "type": "function_call",
                "call_id": str(data.get("id", "")),
                "name": str(data.get("name", "")),
                "arguments": args,
                "status": "completed",
            }
            self.items.append(item)
            idx = len(self.items) - 1
            return (
                out
                + self._ev(
                    "response.output_item.added",
                    output_index=idx,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                + self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=idx,
                    delta=args,
                )
                + self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    name=item["name"],
                    arguments=args,
                )
                + self._ev("response.output_item.done", output_index=idx, item=item)
            )
        if typ == "tool_result":
            out = self._close_text()
            item = {
                "id": f"fco_{os.urandom(8).hex()}",
                "type": "function_call_output",
                "call_id": str(data.get("id", "")),
                "output": _json_text(data.get("output", "")),
                "status": "completed",
            }
            self.items.append(item)
            idx = len(self.items) - 1
            return (
                out
                + self._ev("response.output_item.added", output_index=idx, item=item)
                + self._ev("response.output_item.done", output_index=idx, item=item)
            )
        return b""  # "done" (and unknown events) add nothing

    def finish(self) -> bytes:
        out = self._close_text()
        return out + self._ev("response.completed", response=self.response("completed"))

    def fail(self, err: ServiceError) -> bytes:
        out = self._close_text()
        code = err.code or "agent_error"
        out += self._ev("error", code=code, message=err.message, param=err.param)
        return out + self._ev(
            "response.failed",
            response=self.response("failed", {"code": code, "message": err.message}),
        )

    def whole(self) -> bytes:
        self._close_text()
        return orjson.dumps(self.response("completed"))


class ChatShape:
    def __init__(self, session_id: str, model: str) -> None:
        self.id = f"chatcmpl-{os.urandom(12).hex()}"
        self.session_id = session_id
        self.model = model
        self.created = int(time.time())
        self._parts: list[str] = []

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return frame(
            orjson.dumps(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [
                        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                    ],
                }
            )
        )

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, typ: str, data: dict[str, Any]) -> bytes:
        if typ != "delta":
            return b""
        text = str(data.get("text", ""))
        self._parts.append(text)
        return self._chunk({"content": text}) if text else b""

    def finish(self) -> bytes:
        return self._chunk({}, "stop") + DONE

    def fail(self, err: ServiceError) -> bytes:
        return frame(error_body(err)) + DONE

    def whole(self) -> bytes:
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(self._parts)},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )
