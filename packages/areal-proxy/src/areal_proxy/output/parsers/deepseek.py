"""DeepSeek tool calls.

The markers use FULLWIDTH VERTICAL LINE (U+FF5C) for the bars and LOWER ONE
EIGHTH BLOCK (U+2581) between words; below they are written ``<|tool_calls_begin|>``
etc. for readability (see the constants for the real strings).

V3 / R1-0528::

    <|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>get_weather
    ```json
    {"city": "Paris"}
    ```<|tool_call_end|>
    <|tool_call_begin|>function<|tool_sep|>...<|tool_call_end|><|tool_calls_end|>

V3.1 drops the type and the fence::

    <|tool_calls_begin|><|tool_call_begin|>get_weather<|tool_sep|>{"city": "Paris"}<|tool_call_end|><|tool_calls_end|>

Both forms are read by either name. Each ``<|tool_call_begin|>`` ...
``<|tool_call_end|>`` is one region; the outer begin/end markers are markup
and are always removed from the content.
"""

from __future__ import annotations

import re

from ._text import is_missing, loads_strict, normalize_arguments
from .registry import register_tool_parser
from .tool_base import Region, ToolParser

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"

# V3: function<sep>NAME\n```json\n{...}\n```
_V3 = re.compile(
    r"\s*(?:function)?\s*" + re.escape(SEP) + r"\s*([^\n`]+?)\s*\n\s*```(?:json)?\s*(.*?)\s*```\s*",
    re.S,
)
# V3.1: NAME<sep>{...}
_V31 = re.compile(r"\s*([^\n<`]+?)\s*" + re.escape(SEP) + r"\s*(.*?)\s*", re.S)


def _read_call(inner: str) -> list[tuple[str, str]] | None:
    for pattern in (_V3, _V31):
        m = pattern.fullmatch(inner)
        if m is None:
            continue
        name, raw = m.group(1), m.group(2)
        if pattern is _V31 and name == "function" and not raw.startswith("{"):
            continue
        value = loads_strict(raw)
        if is_missing(value) or not isinstance(value, dict):
            return None
        arguments = normalize_arguments(value)
        return None if arguments is None else [(name, arguments)]
    return None


@register_tool_parser("deepseekv31")
@register_tool_parser("deepseekv3")
class DeepSeekToolParser(ToolParser):
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN)

    def start_region(self, marker: str) -> None:
        self._search_from = 0

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        if marker != CALL_BEGIN:
            return Region(0, [])
        i = body.find(CALL_END, self._search_from)
        if i < 0:
            if not final:
                self._search_from = max(0, len(body) - len(CALL_END) + 1)
                return None
            return Region(len(body), _read_call(body))
        return Region(i + len(CALL_END), _read_call(body[:i]))
