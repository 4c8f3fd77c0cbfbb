"""Tools for a model whose chat template does not render them (SmolLM2's, say).

Rendered through such a template, a request's `tools` would vanish from the prompt: the model
never learns of them, and nothing tells the client. So the template is probed once (a
conversation rendered with and without a sentinel tool: the same text means it ignores
`tools`), and for such a template the proxy writes the tools itself, in the format of the
active tool-call parser, into the system message (added first when the conversation has
none), and the tool loop's turns are put in words such a model follows (with_tools). A parser whose format is made of special
tokens (mistral, deepseek) has no such default prompt: a request with tools is then a 400
naming `tools` (chat_template.ToolsNotRendered), never an answer that ignored them.

Without --tool-call-parser the proxy chooses one from the template (default_tool_parser):
`hermes` for a template that writes `<tool_call>` (the Qwen / Hermes family) or one that does
not render tools at all (the default prompt below is in hermes' format).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Parsers whose call format a plain-text prompt can ask for: how one call is written.
_CALL_FORMATS: dict[str, Callable[[str, str], str]] = {
    "hermes": lambda name, args: (
        f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'
    ),
    "qwen25": lambda name, args: (
        f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'
    ),
    "llama3": lambda name, args: f'{{"name": {name}, "parameters": {args}}}',
}
_SENTINEL = "areal_probe_tool_ignore_me"
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _SENTINEL,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def renders_tools(render: Callable[..., str]) -> bool:
    """Whether a template writes `tools` into the prompt: `render(messages, tools=...)` of a
    probe conversation with and without a sentinel tool differ (a template that fails on the
    probe is taken to render them: it is left to answer requests as it does)."""
    try:
        without = render(_PROBE_MESSAGES, tools=None)
        with_tool = render(_PROBE_MESSAGES, tools=_PROBE_TOOLS)
    except Exception:
        return True
    return with_tool != without


def default_tool_parser(template_source: str, template_renders_tools: bool) -> str:
    """The tool-call parser for a model when --tool-call-parser is not given ("" = none):
    only where the template leaves no doubt."""
    if "<tool_call>" in template_source or not template_renders_tools:
        return "hermes"
    return ""


def can_prompt(parser: str) -> bool:
    return parser in _CALL_FORMATS


def tool_section(tools: list[dict[str, Any]], parser: str) -> str:
    """The system prompt's section that lists `tools` and says how to call one."""
    call = _CALL_FORMATS[parser]
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    first = tools[0].get("function", tools[0])
    example = call(json.dumps(first.get("name", "")), json.dumps(_example_args(first)))
    return (
        "You can call these tools, given as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a tool, reply with only the call, for example:\n"
        f"{example}\n"
        "Once a tool has answered, reply to the user in plain text."
    )


def _example_args(function: dict[str, Any]) -> dict[str, Any]:
    props = (function.get("parameters") or {}).get("properties") or {}
    return {k: "..." for k in props} if isinstance(props, dict) else {}


def with_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: str
) -> list[dict[str, Any]]:
    """`messages` with the tool section in the system message, and the tool loop in words such
    a template's model follows: an assistant turn's calls are left out (its text kept) and a
    tool's result is a user turn naming the tool. Measured on SmolLM2-135M at temperature 0:
    shown its own call and a `tool` turn, it repeated the call (an agent loop never ended);
    shown this, it answered from the result."""
    section = tool_section(tools, parser)
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            for c in m["tool_calls"]:
                if isinstance(c, dict):
                    names[str(c.get("id", ""))] = str((c.get("function") or {}).get("name", ""))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            if m.get("content") is None:
                m["content"] = ""
        elif role == "tool":
            name = names.get(str(m.get("tool_call_id", "")), "") or "the tool"
            who = f"The tool {name}" if name != "the tool" else "The tool"
            m = {"role": "user", "content": f"{who} answered: {_text(m.get('content'))}"}
        out.append(m)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
