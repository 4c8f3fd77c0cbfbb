"""Result and streaming-event types shared by every parser family."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One complete tool call."""

    id: str
    name: str
    # JSON text of the arguments object; always valid JSON, "{}" when none.
    arguments: str


@dataclass(slots=True)
class ParsedOutput:
    # None when empty and there are tool calls.
    content: str | None
    # None when the reasoning parser found none or is off.
    reasoning_content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Tool calls the output made, read or not (`tool_calls` holds those read): set by
    # OutputParser.parse; 0 from `collect` alone.
    calls_made: int = 0


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    # Set on the first delta of a call.
    id: str | None = None
    name: str | None = None
    # A piece of the arguments JSON text.
    arguments: str = ""


StreamEvent = ContentDelta | ReasoningDelta | ToolCallDelta
