"""DeepSeek tool calls (note the full-width bars and the ▁ characters).

V3 / R1-0528:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Both forms are read by either name. Each ``<｜tool▁call▁begin｜>`` ...
``<｜tool▁call▁end｜>`` is one region; the outer begin/end markers are markup
and are always removed from the content.
"""

from __future__ import annotations

import re

from ._text import is_missing, loads_strict, normalize_arguments
from .registry import register_tool_parser
from .tool_base import Region, ToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

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
