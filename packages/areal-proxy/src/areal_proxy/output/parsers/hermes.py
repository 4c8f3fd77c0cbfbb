"""Hermes / Qwen2.5 / Qwen3 tool calls.

    text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ..., "arguments": {...}}
    </tool_call>

A region runs from ``<tool_call>`` to its ``</tool_call>`` (or the end of
the output); its inside must be one JSON call object (a list of them is
accepted too). The end of the JSON is found first, so a ``</tool_call>``
inside a string argument does not end the call.
"""

from __future__ import annotations

from ._text import JsonEnd, calls_from_json
from .registry import register_tool_parser
from .tool_base import Region, ToolParser


@register_tool_parser("qwen25")
@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    markers = ("<tool_call>",)
    end = "</tool_call>"

    def start_region(self, marker: str) -> None:
        self._search_from = 0
        self._scan = JsonEnd()
        self._json_at = -1

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        if self._json_at < 0:
            stripped = body.lstrip()
            if not stripped:
                return None if not final else Region(len(body), None, cut=True)
            if stripped[0] in "{[":
                self._json_at = len(body) - len(stripped)
        if self._json_at >= 0:
            # Find the end of the JSON first, so "</tool_call>" inside a string
            # argument does not cut the call short.
            end = self._scan.scan(body[self._json_at :])
            if end is None:
                return None if not final else Region(len(body), None, cut=True)
            end += self._json_at
            rest = body[end:].lstrip()
            if not rest:
                return None if not final else Region(len(body), calls_from_json(body))
            if rest.startswith(self.end):
                close = len(body) - len(rest)
                return Region(close + len(self.end), calls_from_json(body[:close]))
            if not final and self.end.startswith(rest):
                return None
            # Something else follows the JSON: not a clean call.
        return self._up_to_end_tag(body, final)

    def _up_to_end_tag(self, body: str, final: bool) -> Region | None:
        i = body.find(self.end, self._search_from)
        if i < 0:
            if not final:
                self._search_from = max(0, len(body) - len(self.end) + 1)
                return None
            calls = calls_from_json(body)
            return Region(len(body), calls, cut=calls is None)
        return Region(i + len(self.end), calls_from_json(body[:i]))
