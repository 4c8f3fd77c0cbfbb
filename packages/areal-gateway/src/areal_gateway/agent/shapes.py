"""Agent events -> OpenAI shapes: the Responses API and chat completions.

An agent turn is a sequence of events (`delta`, `tool_call`, `tool_result`, `done`, `error`).
A shape turns each event into the frames a streaming client gets at once, and keeps what the
non-streamed answer needs. Both shapes see the same events in the same order.

Responses (built by `areal_gateway.openai.responses.events`, shared with the inference
gateway's `/v1/responses`): text deltas fill a `message` output item (a new one after each
tool event); a tool call is a `function_call` item; a tool result a `function_call_output`
item (the agent ran the tool itself). Chat: the agent is a model; only its text reaches the
client.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson

from areal_gateway.openai.errors import error_body
from areal_gateway.openai.responses.events import ResponseBuilder, new_id
from areal_gateway.openai.sse import DONE, frame
from areal_runtime.errors import AgentError, ServiceError


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
    """Agent events -> the Responses object and events (openai/responses/events.py, the
    implementation the inference gateway's `/v1/responses` uses too)."""

    def __init__(
        self,
        session_id: str,
        model: str,
        metadata: dict[str, Any],
        previous_response_id: str | None,
        store: bool = True,
    ) -> None:
        self.id = response_id(session_id)
        self.model = model
        self.metadata = metadata
        self.previous_response_id = previous_response_id
        self.builder = ResponseBuilder(
            self.id,
            model,
            metadata=metadata,
            previous_response_id=previous_response_id,
            echo={"store": store},
        )

    @property
    def items(self) -> list[dict[str, Any]]:
        return self.builder.items

    def start(self) -> bytes:
        return self.builder.start()

    def event(self, typ: str, data: dict[str, Any]) -> bytes:
        b = self.builder
        if typ == "delta":
            return b.text(str(data.get("text", "")))
        if typ == "tool_call":
            args = _json_text(data.get("arguments", {}))
            return b.call(str(data.get("id", "")), str(data.get("name", "")), args)
        if typ == "tool_result":
            return b.item(
                {
                    "id": new_id("fco"),
                    "type": "function_call_output",
                    "call_id": str(data.get("id", "")),
                    "output": _json_text(data.get("output", "")),
                    "status": "completed",
                }
            )
        return b""  # "done" (and unknown events) add nothing

    def finish(self) -> bytes:
        return self.builder.finish()

    def fail(self, err: ServiceError) -> bytes:
        return self.builder.fail(err.code or "agent_error", err.message, err.param)

    def whole(self) -> bytes:
        return self.builder.whole()


class ChatShape:
    def __init__(self, session_id: str, model: str) -> None:
        self.id = f"chatcmpl-{os.urandom(12).hex()}"
        self.session_id = session_id
        self.model = model
        self.created = int(time.time())
        self._parts: list[str] = []
        # The agent's own tool calls (it ran them): the message's `tool_calls`, so a chat
        # client sees what the agent did. The turn is over, so the finish stays "stop".
        self._calls: list[dict[str, Any]] = []

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
        if typ == "tool_call":
            if not isinstance(data.get("name"), str) or not data["name"]:
                return b""  # not a call a client could read
            call = {
                "id": str(data.get("id") or f"call_{os.urandom(8).hex()}"),
                "type": "function",
                "function": {
                    "name": str(data.get("name", "")),
                    "arguments": _json_text(data.get("arguments", {})),
                },
            }
            self._calls.append(call)
            return self._chunk({"tool_calls": [{"index": len(self._calls) - 1, **call}]})
        if typ != "delta":
            return b""
        text = str(data.get("text", ""))
        self._parts.append(text)
        return self._chunk({"content": text}) if text else b""

    def finish(self) -> bytes:
        return self._chunk({}, "stop") + DONE

    def fail(self, err: ServiceError) -> bytes:
        return frame(error_body(err)) + DONE

    def _message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self._parts)}
        if self._calls:
            msg["tool_calls"] = self._calls
        return msg

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
                        "message": self._message(),
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )
