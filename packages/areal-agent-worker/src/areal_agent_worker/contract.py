"""What an agent receives and how it emits events (the user-facing contract).

    class MyAgent:
        async def run(self, request: AgentRequest, *, emitter: Emitter) -> str | None:
            await emitter.delta("thinking about ")
            await emitter.delta(request.message_text)
            return None          # or a final text, sent as one delta if nothing was emitted

        async def close_session(self, session_id: str) -> None: ...   # optional
        async def shutdown(self) -> None: ...                          # optional

`run` is called once per turn, turns of one session never overlap. Events
reach the client as they are emitted, not when `run` returns.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class InferenceLink:
    """Where the agent sends its LLM calls when linked to an areal inference service.

    `api_key` is the agent session's own RL session key: every call made with
    it is recorded on that session (token ids, logprobs, versions).
    """

    base_url: str
    api_key: str
    model: str


@dataclass(frozen=True, slots=True)
class AgentRequest:
    message: Any
    session_id: str
    history: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    inference: InferenceLink | None = None

    @property
    def message_text(self) -> str:
        m = self.message
        if isinstance(m, str):
            return m
        if isinstance(m, dict):
            m = m.get("content", "")
            if isinstance(m, str):
                return m
        if isinstance(m, list):
            return "".join(p.get("text", "") for p in m if isinstance(p, dict))
        return str(m)


@dataclass(frozen=True, slots=True)
class AgentEvent:
    type: str  # "delta", "tool_call", "tool_result", "done", "error"
    data: dict[str, Any]


class Emitter:
    """Hands events to the worker as the agent produces them."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[AgentEvent | None] = asyncio.Queue()
        self.emitted_text = False

    async def delta(self, text: str) -> None:
        if text:
            self.emitted_text = True
            await self._queue.put(AgentEvent("delta", {"text": text}))

    async def tool_call(self, name: str, arguments: Any, call_id: str = "") -> str:
        import secrets

        call_id = call_id or f"call_{secrets.token_hex(8)}"
        await self._queue.put(
            AgentEvent("tool_call", {"id": call_id, "name": name, "arguments": arguments})
        )
        return call_id

    async def tool_result(self, call_id: str, output: Any) -> None:
        await self._queue.put(AgentEvent("tool_result", {"id": call_id, "output": output}))

    # Upstream's names, so agents written for it run unchanged.
    emit_delta = delta
    emit_tool_call = tool_call
    emit_tool_result = tool_result
