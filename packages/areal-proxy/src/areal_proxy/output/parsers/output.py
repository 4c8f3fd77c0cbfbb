"""OutputParser / OutputStreamer: reasoning first, then tool calls on the content."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .reasoning import ReasoningParser
from .registry import check_parser_names, get_reasoning_parser, get_tool_parser
from .tool_base import ToolParser
from .types import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCall,
)


class OutputStreamer:
    """Turns the text deltas of one response into content/reasoning/tool-call deltas.

    Concatenating the emitted deltas of each kind gives exactly what
    ``OutputParser.parse`` returns for the whole text, however it was split.
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def saw_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.saw_tool_calls

    @property
    def call_counts(self) -> tuple[int, int]:
        """(tool calls the output made, calls the parser read); (0, 0) without tool parsing."""
        return self._tools.call_counts if self._tools is not None else (0, 0)

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._reasoning is None:
            return self._to_tools([ContentDelta(delta)] if delta else [], final=False)
        return self._to_tools(self._reasoning.feed(delta), final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._reasoning.finish() if self._reasoning is not None else []
        return self._to_tools(events, final=True)

    def _to_tools(
        self, events: Iterable[ContentDelta | ReasoningDelta], final: bool
    ) -> list[StreamEvent]:
        if self._tools is None:
            return list(events)
        out: list[StreamEvent] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.extend(self._tools.feed(event.text))
            else:
                out.append(event)
        if final:
            out.extend(self._tools.finish())
        return out


class OutputParser:
    """Parses engine output text for one request.

    Tool parsing is on only when ``tool_parser`` is set and ``tools`` (the
    request's OpenAI ``tools``) is non-empty; pass ``tools=None`` when the
    request's ``tool_choice`` is ``"none"``. Reasoning is split off first and
    tool calls are read from the rest.
    """

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        check_parser_names(tool_parser, reasoning_parser)
        self._tools = list(tools) if tools else []
        self._tool_cls = get_tool_parser(tool_parser) if tool_parser and self._tools else None
        self._reasoning_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    @property
    def tools_active(self) -> bool:
        return self._tool_cls is not None

    @property
    def reasoning_active(self) -> bool:
        return self._reasoning_cls is not None

    def streamer(self) -> OutputStreamer:
        return OutputStreamer(
            self._reasoning_cls() if self._reasoning_cls is not None else None,
            self._tool_cls(self._tools) if self._tool_cls is not None else None,
        )

    def parse(self, text: str) -> ParsedOutput:
        streamer = self.streamer()
        events = streamer.feed(text)
        events.extend(streamer.finish())
        out = collect(events)
        out.calls_made = streamer.call_counts[0]
        return out


def collect(events: Iterable[StreamEvent]) -> ParsedOutput:
    """Fold streamed deltas into the ParsedOutput that ``parse`` returns."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        else:
            call = calls.get(event.index)
            if call is None:
                call = calls[event.index] = ToolCall(
                    id=event.id or "", name=event.name or "", arguments=""
                )
            elif event.name:
                call.name += event.name
            if event.id and not call.id:
                call.id = event.id
            call.arguments += event.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    for call in tool_calls:
        if not call.arguments:
            call.arguments = "{}"
    text = "".join(content)
    thought = "".join(reasoning)
    return ParsedOutput(
        content=None if (not text and tool_calls) else text,
        reasoning_content=thought or None,
        tool_calls=tool_calls,
    )
