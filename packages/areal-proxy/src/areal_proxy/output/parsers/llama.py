"""Llama 3.x JSON tool calls.

The whole output is the call, optionally after ``<|python_tag|>``; several
calls are separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

A bare ``{`` opens a call only at the start of the output; ``<|python_tag|>``
opens one anywhere (text before it is content). ``"arguments"`` is accepted
in place of ``"parameters"``. A JSON object that is not a call (a model
answering in JSON) stays content.
"""

from __future__ import annotations

from ._text import JsonEnd, call_from_object, is_missing, loads_strict
from .registry import register_tool_parser
from .tool_base import Region, ToolParser

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3")
class Llama3JsonToolParser(ToolParser):
    markers = (PYTHON_TAG,)
    leading_markers = ("{",)

    def start_region(self, marker: str) -> None:
        self._scan = JsonEnd()
        self._lead = -1  # where the object starts inside the body (python tag case)

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        if marker == "{":
            text, offset = "{" + body, -1
        else:
            if self._lead < 0:
                stripped = body.lstrip()
                if not stripped:
                    return None if not final else Region(0, None)
                if not stripped.startswith("{"):
                    # Not a JSON call (e.g. a built-in tool call): the tag is content.
                    return Region(0, None)
                self._lead = len(body) - len(stripped)
            offset = self._lead
            text = body[offset:]
        end = self._scan.scan(text)
        if end is None:
            return None if not final else Region(len(body), None)
        consumed = end + offset
        value = loads_strict(text[:end])
        call = None if is_missing(value) else call_from_object(value)
        return Region(consumed, None if call is None else [call])

    def continuation(self, text: str, final: bool) -> tuple[int, str] | None:
        stripped = text.lstrip()
        if not stripped:
            return None if not final else (0, "")
        if stripped[0] != ";":
            return (0, "")
        rest = stripped[1:].lstrip()
        if not rest:
            return None if not final else (0, "")
        if rest[0] != "{":
            return (0, "")
        return (len(text) - len(rest) + 1, "{")
