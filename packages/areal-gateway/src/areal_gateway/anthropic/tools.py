"""A Messages request's `tools` and `tool_choice` -> the chat body's function tools.

- A custom tool (`type` absent or `custom`: `name`, `description`, `input_schema`, `strict`)
  is a function tool. `cache_control` (the engine's prefix cache is automatic) and
  `eager_input_streaming` (how its input streams, not what it is) change nothing.
- `defer_loading: true`: left out of the prompt, as Anthropic leaves it out (the model sees a
  deferred tool only once the client's tool search loads it). A call the model makes to it
  is still parsed and answered as a `tool_use` (the proxy's tool-call parsers take any name).
- A tool the model may call only from code execution (`allowed_callers` without `direct`),
  and every server or Anthropic-defined tool (`web_search_*`, `web_fetch_*`,
  `code_execution_*`, `bash_*`, `text_editor_*`, ...: any other `type`): areal runs none of
  them and knows no built-in tool's schema, so they are left out of the prompt and reported
  (left_out.py), never a 400 that would stop a harness on its first turn.
- `input_examples`: Anthropic shows them to the model; a chat template has no place for
  them, so they are left out (reported) and the tool goes in without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_gateway.anthropic.conversation import string_field
from areal_gateway.anthropic.errors import invalid, unsupported
from areal_gateway.left_out import LeftOut

# Keys of a custom tool that are acted on, or change nothing.
_TOOL_KEYS = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "cache_control",
        "strict",
        "defer_loading",
        "allowed_callers",
        "eager_input_streaming",
        "input_examples",
    }
)


def _flag(tool: dict[str, Any], key: str, path: str) -> bool:
    value = tool.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{path}.{key}", "must be a boolean")
    return value


def _called_directly(tool: dict[str, Any], path: str) -> bool:
    callers = tool.get("allowed_callers")
    if callers is None:
        return True
    if not isinstance(callers, list) or not all(isinstance(c, str) for c in callers):
        raise invalid(f"{path}.allowed_callers", "must be an array of strings")
    return "direct" in callers


@dataclass(slots=True)
class Tools:
    """A request's tools: the chat's function tools (what the prompt shows), and every
    custom tool's chat `function` by name, deferred ones included (what a tool search's
    `tool_reference` may load: tool_reference.py)."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    defined: dict[str, dict[str, Any]] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)


def translate_tools(raw: Any, left_out: LeftOut) -> Tools:
    """The request's tools. Server tools and tools only code execution may call are left
    out and reported in `left_out`."""
    if not isinstance(raw, list):
        raise invalid("tools", "must be an array of tools")
    tools = Tools()
    for i, tool in enumerate(raw):
        p = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(p, "a tool must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise invalid(f"{p}.type", "must be a string")
            left_out.add(
                p,
                "server_tool",
                f"tool type {kind!r}: areal runs no server tools and knows no built-in "
                "tool's schema (define it as a custom tool with an input_schema to offer it)",
            )
            continue
        for key, value in tool.items():
            if key not in _TOOL_KEYS and value is not None:
                raise unsupported(f"{p}.{key}", "is not supported by areal")
        name = string_field(tool.get("name"), f"{p}.name", empty=False)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{p}.input_schema", "must be a JSON schema object")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = string_field(tool["description"], f"{p}.description")
        if tool.get("strict") is not None:
            fn["strict"] = _flag(tool, "strict", p)
        _flag(tool, "eager_input_streaming", p)
        if _flag(tool, "defer_loading", p):
            tools.defined[name] = fn
            tools.deferred.add(name)
            continue
        if not _called_directly(tool, p):
            left_out.add(
                p,
                "code_execution_tool",
                f"tool {name!r} may be called only from code execution, which areal does not run",
            )
            continue
        if tool.get("input_examples") is not None:
            if not isinstance(tool["input_examples"], list):
                raise invalid(f"{p}.input_examples", "must be an array of objects")
            if tool["input_examples"]:
                left_out.add(
                    f"{p}.input_examples",
                    "tool_input_examples",
                    "a chat template has no place for a tool's input examples",
                )
        tools.defined[name] = fn
        tools.chat.append({"type": "function", "function": fn})
    return tools


def translate_tool_choice(
    raw: Any, names: set[str], deferred: set[str], chat: dict[str, Any]
) -> None:
    """`tool_choice` onto `chat` (`names`: the tools in the prompt)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise invalid("tool_choice", "must be an object with a 'type'")
    kind = raw["type"]
    if kind == "auto":
        choice: Any = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool":
        name = string_field(raw.get("name"), "tool_choice.name", empty=False)
        if name in deferred:
            raise invalid(
                "tool_choice.name",
                f"{name!r} is a deferred tool (defer_loading), not in the prompt: the model "
                "cannot be made to call a tool it has not been shown",
            )
        if name not in names:
            raise invalid(
                "tool_choice.name",
                f"no tool named {name!r} in 'tools' (server tools are left out of the prompt)",
            )
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise invalid("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if kind in ("any", "tool") and not names:
        raise invalid("tool_choice", f"tool_choice {kind!r} needs custom 'tools' in the prompt")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise invalid("tool_choice.disable_parallel_tool_use", "must be a boolean")
        if disable:
            chat["parallel_tool_calls"] = False
    if names:
        chat["tool_choice"] = choice
