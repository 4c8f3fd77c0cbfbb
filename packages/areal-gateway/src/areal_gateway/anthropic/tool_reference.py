"""`tool_reference` blocks in a tool result: a client-side tool search loading deferred tools.

A harness with many tools marks most of them `defer_loading` (left out of the prompt: see
tools.py) and gives the model a search tool; the search's `tool_result` holds one
`tool_reference` block (`tool_name`) per tool found, and Anthropic expands each into the
tool's full definition for the model. areal expands it the same way, in place: the tool
message reads

    <functions>
    <function>{"description": ..., "name": ..., "parameters": {...}}</function>
    </functions>

(the encoding Claude Code's ToolSearch tells the model its results come in), one line per
referenced tool, after the result's text blocks. In place, not added to the prompt's tool
list: the prompt before it stays exactly what was sampled from (an RL session's next turn
continues it), and the proxy's tool-call parsers take a call to any name, so the model may
call the loaded tool from then on.
"""

from __future__ import annotations

import json
from typing import Any

from areal_gateway.anthropic.errors import invalid


def _line(fn: dict[str, Any]) -> str:
    shown = {"description": fn.get("description", ""), "name": fn["name"]}
    shown["parameters"] = fn.get("parameters", {})
    return f"<function>{json.dumps(shown, ensure_ascii=False)}</function>"


def expand(names: list[tuple[str, str]], definitions: dict[str, dict[str, Any]]) -> str:
    """The text for the referenced tools (`names`: (tool_name, block path))."""
    lines = []
    for name, path in names:
        fn = definitions.get(name)
        if fn is None:
            raise invalid(
                f"{path}.tool_name",
                f"{name!r} names no custom tool in 'tools' (a tool search may load only tools "
                "the request defines, deferred or not)",
            )
        lines.append(_line(fn))
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"
