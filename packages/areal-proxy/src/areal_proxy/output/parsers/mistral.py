"""Mistral tool calls.

Older models (tokenizer before v11) emit a JSON list after one marker:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

newer ones (v11+) repeat the marker per call, name then arguments:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{}

``[ARGS]`` may be missing (``[TOOL_CALLS]name{...}``) and a
``[CALL_ID]id`` may sit between name and ``[ARGS]``; the model's call id is
not kept (ids are always ``call_<hex>``).
"""

from __future__ import annotations

import re

from ._text import JsonEnd, calls_from_json, is_missing, loads_strict, normalize_arguments
from .registry import register_tool_parser
from .tool_base import Region, ToolParser

TOOL_CALLS = "[TOOL_CALLS]"
# What may stand between [TOOL_CALLS] and the arguments object in the v11 form.
_HEADER = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*[\w\-]+\s*)?(?:\[ARGS\])?\s*", re.ASCII)
_HEADER_CHARS = re.compile(r"[\w.\-\[\]\s]*", re.ASCII)
_MAX_HEADER = 256


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS,)

    def start_region(self, marker: str) -> None:
        self._scan = JsonEnd()
        self._value_at = -1  # where the JSON value starts in the body

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        if self._value_at < 0:
            stripped = body.lstrip()
            if stripped.startswith("["):
                self._value_at = len(body) - len(stripped)
            else:
                brace = body.find("{")
                header = body if brace < 0 else body[:brace]
                ok_chars = _HEADER_CHARS.match(header)
                assert ok_chars is not None
                if ok_chars.end() < len(header) or len(header) > _MAX_HEADER:
                    # Cannot be a call header any more: the marker is content.
                    return Region(0, None)
                if brace < 0:
                    if not final:
                        return None
                    return Region(0, None)
                if not _HEADER.fullmatch(header):
                    return Region(0, None)
                self._value_at = brace
        start = self._value_at
        text = body[start:]
        end = self._scan.scan(text)
        if end is None:
            return None if not final else Region(len(body), None)
        consumed = start + end
        if text[0] == "[":
            return Region(consumed, calls_from_json(text[:end]))
        m = _HEADER.fullmatch(body[:start])
        assert m is not None
        value = loads_strict(text[:end])
        arguments = None if is_missing(value) else normalize_arguments(value)
        if arguments is None or not isinstance(value, dict):
            return Region(consumed, None)
        return Region(consumed, [(m.group(1), arguments)])
