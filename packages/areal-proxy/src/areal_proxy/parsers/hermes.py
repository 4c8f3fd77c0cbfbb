"""Hermes / Qwen2.5 / Qwen3 tool calls.

    text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": {...}}
    </tool_call>

A region runs from ``<tool_call>`` to the next ``</tool_call>`` (or the end
of the output); its inside must be one JSON call object (a list of them is
accepted too).
"""

from __future__ import annotations

from ._text import calls_from_json
from .registry import register_tool_parser
from .tool_base import Region, ToolParser


@register_tool_parser("qwen25")
@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    markers = ("<tool_call>",)
    end = "</tool_call>"

    def start_region(self, marker: str) -> None:
        self._search_from = 0

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        i = body.find(self.end, self._search_from)
        if i < 0:
            if not final:
                self._search_from = max(0, len(body) - len(self.end) + 1)
                return None
            return Region(len(body), calls_from_json(body))
        return Region(i + len(self.end), calls_from_json(body[:i]))
