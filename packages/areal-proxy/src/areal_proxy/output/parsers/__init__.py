"""Tool-call and reasoning parsers: engine output text -> OpenAI chat fields.

    parser = OutputParser("hermes", "qwen3", tools=request_tools)
    parsed = parser.parse(text)                  # whole output
    streamer = parser.streamer()                 # or delta by delta
    events = streamer.feed(delta) ... streamer.finish()

Families register themselves by name (``register_tool_parser`` /
``register_reasoning_parser``); importing this package loads them all.
"""

from __future__ import annotations

from . import deepseek, hermes, llama, mistral  # noqa: F401  (register the families)
from .output import OutputParser, OutputStreamer, collect
from .reasoning import ReasoningParser
from .registry import (
    check_parser_names,
    reasoning_parser_names,
    register_reasoning_parser,
    register_tool_parser,
    tool_parser_names,
)
from .tool_base import Region, ToolParser
from .types import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
)

__all__ = [
    "ContentDelta",
    "OutputParser",
    "OutputStreamer",
    "ParsedOutput",
    "ReasoningDelta",
    "ReasoningParser",
    "Region",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "check_parser_names",
    "collect",
    "reasoning_parser_names",
    "register_reasoning_parser",
    "register_tool_parser",
    "tool_parser_names",
]
