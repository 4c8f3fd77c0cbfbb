"""A SCRIPTED inference proxy for the Responses tests: it answers the chat body the gateway
sends with a fixed output chosen by a script (text, reasoning, tool calls, a length stop),
streamed as the real proxy streams it (role chunk, reasoning / content / tool-call deltas,
finish chunk, usage chunk), and keeps every chat body it got.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc


@dataclass
class Output:
    content: str | None = None
    reasoning: str | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    finish: str = "stop"


def _pieces(text: str, n: int = 3) -> list[str]:
    step = max(1, len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]


class ScriptedProxy(
    proxy_pb2_grpc.InferenceProxyServiceServicer, proxy_pb2_grpc.ProxyStatusServiceServicer
):
    """Answers each chat body with `script(model, messages)`; keeps every body it got."""

    def __init__(self, script: Callable[[str, list[dict[str, Any]]], Output]) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.ids: list[str] = []  # of the whole answers
        self.hang = asyncio.Event()

    def _take(self, request: Any) -> tuple[dict[str, Any], Output]:
        doc = orjson.loads(request.body)
        self.bodies.append(doc)
        return doc, self.script(request.envelope.model, doc["messages"])

    async def GetStats(self, request: Any, context: Any) -> Any:
        return proxy_pb2.ProxyStats(healthy=True, detail="SCRIPTED proxy")

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        doc, out = self._take(request)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in out.calls
            ]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": out.finish}
        if doc.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": -0.5, "bytes": list(p.encode()), "top_logprobs": []}
                    for p in _pieces(out.content or "")
                ]
            }
        self.ids.append(f"chatcmpl-{len(self.bodies):024x}")
        body = {
            "id": self.ids[-1],
            "object": "chat.completion",
            "created": 1,
            "model": request.envelope.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
        }
        return envelope_pb2.OpenAIResponse(body=orjson.dumps(body))

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        doc, out = self._take(request)
        rid = request.envelope.request_id
        cid = "chatcmpl-" + rid.encode().hex()[:24].ljust(24, "0")

        def chunk(delta: dict[str, Any], finish: str | None = None) -> Any:
            c = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 1,
                "model": request.envelope.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                "usage": None,
            }
            return envelope_pb2.StreamChunk(data=orjson.dumps(c))

        try:
            yield chunk({"role": "assistant", "content": ""})
            for p in _pieces(out.reasoning or ""):
                yield chunk({"reasoning_content": p})
            if doc["messages"][-1].get("content") == "hang":
                yield chunk({"content": "waiting"})
                await asyncio.sleep(30)
            for p in _pieces(out.content or ""):
                yield chunk({"content": p})
            for k, (i, n, a) in enumerate(out.calls):
                yield chunk(
                    {
                        "tool_calls": [
                            {"index": k, "id": i, "type": "function", "function": {"name": n}}
                        ]
                    }
                )
                for p in _pieces(a):
                    yield chunk({"tool_calls": [{"index": k, "function": {"arguments": p}}]})
            yield chunk({}, out.finish)
            usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
            yield envelope_pb2.StreamChunk(
                data=orjson.dumps({"id": cid, "choices": [], "usage": usage})
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.splitlines()
        if not lines:
            continue
        assert lines[0].startswith("event: "), block
        data = orjson.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: ")
        out.append(data)
    return out
