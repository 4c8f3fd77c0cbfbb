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
    example = call(json.dumps(first.get("name", "")), _unquoted(json.dumps(_example_args(first))))
    return (
        "You can call these tools, given as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a tool, reply with only the call, for example:\n"
        f"{example}\n"
        "In a call, write each argument's real value for this request where the example "
        "shows its type (<string>, <integer> and so on).\n"
        "Once a tool has answered, reply to the user in plain text."
    )


def _unquoted(example: str) -> str:
    """The type markers written bare (`"age": <integer>`): not a JSON value, so a call
    constrained to JSON cannot copy one as it stands, and a model reads it as a slot."""
    for marker in _MARKERS:
        example = example.replace(json.dumps(marker), marker)
    return example


def _example_args(function: dict[str, Any]) -> dict[str, Any]:
    """The example call's arguments: each parameter's own example value where its schema
    gives one (`examples`, `example`, `default`, `enum`, `const`), else its type in angle
    brackets (written bare, `_unquoted`). A placeholder that reads as a value ("...") was
    copied into forced calls as it stood (SmolLM2: `{"name": "...", "country": "..."}`),
    where the same schema as a `response_format` got real values."""
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return {}
    return {k: _example_value(v, 0) for k, v in props.items()}


_TYPE_WORDS = {
    "string": "<string>",
    "integer": "<integer>",
    "number": "<number>",
    "boolean": "<true or false>",
    "null": None,
}
_MARKERS = ("<string>", "<integer>", "<number>", "<true or false>", "<value>")


def _example_value(schema: Any, depth: int) -> Any:
    if not isinstance(schema, dict):
        return "<value>"
    examples = schema.get("examples")
    if isinstance(examples, list) and examples:
        return examples[0]
    for key in ("example", "default", "const"):
        if key in schema:
            return schema[key]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" and depth < 2:
        props = schema.get("properties")
        if isinstance(props, dict) and props:
            return {k: _example_value(v, depth + 1) for k, v in props.items()}
        return {}
    if kind == "array" and depth < 2:
        return [_example_value(schema.get("items"), depth + 1)]
    if kind in _TYPE_WORDS:
        return _TYPE_WORDS[kind]
    return "<value>"


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
