"""The bridge to areal_proxy.output.parsers (tool calls, reasoning): imported only when a parser
is configured, so a proxy without parsers never pays for them."""

from __future__ import annotations

from typing import Any

# --tool-call-parser none: no tool-call parser, not even the one the chat template suggests.
NO_PARSER = "none"


def check_parsers(tool_parser: str, reasoning_parser: str) -> None:
    """Fail at start (ValueError) on a parser name the parsers package does not know."""
    tool_parser = "" if tool_parser == NO_PARSER else tool_parser
    if not tool_parser and not reasoning_parser:
        return
    from areal_proxy.output.parsers import check_parser_names

    check_parser_names(tool_parser or None, reasoning_parser or None)


def make_output_parser(
    tool_parser: str, reasoning_parser: str, tools: list[dict[str, Any]] | None
) -> Any | None:
    """An OutputParser for one request, or None when the text is plain content."""
    tool = tool_parser if tools else ""
    if not tool and not reasoning_parser:
        return None
    from areal_proxy.output.parsers import OutputParser

    return OutputParser(tool or None, reasoning_parser or None, tools if tool else None)


def collect_events(events: list[Any]) -> Any:
    """The ParsedOutput that streamed parser events add up to (their tool call ids kept)."""
    from areal_proxy.output.parsers.output import collect

    return collect(events)


def first_call_only(events: list[Any]) -> list[Any]:
    """The events without those of a second or later tool call (`parallel_tool_calls: false`)."""
    from areal_proxy.output.parsers import ToolCallDelta

    return [e for e in events if not (isinstance(e, ToolCallDelta) and e.index > 0)]


def delta_dicts(deltas: list[Any]) -> list[dict[str, Any]]:
    """Parser deltas -> OpenAI chat `delta` objects, consecutive ones of a kind merged."""
    from areal_proxy.output.parsers import ContentDelta, ReasoningDelta, ToolCallDelta

    out: list[dict[str, Any]] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta):
            if not d.text:
                continue
            if last is not None and "content" in last:
                last["content"] += d.text
            else:
                out.append({"content": d.text})
        elif isinstance(d, ReasoningDelta):
            if not d.text:
                continue
            if last is not None and "reasoning_content" in last:
                last["reasoning_content"] += d.text
            else:
                out.append({"reasoning_content": d.text})
        elif isinstance(d, ToolCallDelta):
            call: dict[str, Any] = {"index": d.index}
            if d.id:
                call["id"] = d.id
                call["type"] = "function"
            fn: dict[str, Any] = {}
            if d.name:
                fn["name"] = d.name
            if d.arguments is not None:
                fn["arguments"] = d.arguments
            call["function"] = fn
            if last is not None and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"tool_calls": [call]})
    return out
