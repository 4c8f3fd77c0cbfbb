"""A Responses request's `tools` and `tool_choice` -> chat function tools, and the way back.

A chat template knows one kind of tool, a function with a JSON-schema `parameters`. What a
Responses client declares, and what areal gives the model for it:

- `function`: the chat function of that name.
- `namespace` (`{"type": "namespace", "name", "description", "tools": [function tools]}`,
  how Codex CLI groups its sub-agent tools): each inner tool is a chat function of its own.
  Its chat name is its inner name when no other tool of the request is called that, else
  `<namespace>__<name>`; a name still taken after that is a 400. The namespace's own
  description has no place in a chat tool and is not given. A model's call of such a tool is
  answered as the client dispatches it: a `function_call` item with `name` the inner name and
  `namespace` the namespace's.
- `custom` (freeform input, optionally with a grammar: Codex's `apply_patch` for some
  models): a chat function with one string parameter `input`, whose description carries the
  grammar's definition when there is one (areal cannot constrain decoding to it; reported as
  left out). A model's call is a `custom_tool_call` item whose `input` is that string
  argument (the call's raw arguments when they hold no string `input`).
- any other type (`web_search`, `file_search`, `code_interpreter`, `image_generation`,
  `computer_use_preview`, `mcp`, `local_shell`, ...: run by OpenAI's servers, or needing a
  schema areal does not have): left out of the prompt, so the model is never told of a tool
  it cannot have, and reported (left_out.py). A `tool_choice` that forces one is a 400.

`Tools` keeps the chat name of every declared tool both ways: the request's input items
(a call the model made in an earlier turn, as the client hands it back) become the chat
call the model produced, and the answer's chat calls become the client's items.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from areal_gateway.left_out import LeftOut
from areal_gateway.openai.errors import bad_request
from areal_runtime.errors import InvalidRequest

# The hosted tool types OpenAI documents; another type is counted as `tool.other` (a metric
# label never carries a client's string).
HOSTED = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
# Joins a namespace and an inner name when the inner name alone is taken. Two underscores:
# OpenAI's function names allow [A-Za-z0-9_-], so no dot.
NAMESPACE_JOIN = "__"


def unsupported(param: str, message: str) -> InvalidRequest:
    return bad_request(message, code="unsupported_parameter", param=param)


def invalid(param: str, message: str, code: str = "invalid_type") -> InvalidRequest:
    return bad_request(message, code=code, param=param)


@dataclass(frozen=True, slots=True)
class ToolRef:
    """A chat function as the client declared it."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(slots=True)
class Tools:
    """The chat tools of one request and the names both ways."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    echo: list[dict[str, Any]] = field(default_factory=list)
    by_chat: dict[str, ToolRef] = field(default_factory=dict)
    by_client: dict[tuple[str | None, str], str] = field(default_factory=dict)

    def chat_name(self, name: str, namespace: str | None) -> str:
        """The chat name of a client's (namespace, name). A namespace this request does not
        declare any more: the inner name, the chat name such a tool gets when it is unique."""
        return self.by_client.get((namespace, name), name)

    def ref(self, chat_name: str) -> ToolRef:
        """What a chat call names; a name the request never declared stays as it is (the
        client answers a call of an unknown tool itself)."""
        return self.by_chat.get(chat_name) or ToolRef(chat_name)


def custom_input(arguments: str) -> str:
    """A custom tool's `input` from the chat call's arguments."""
    try:
        doc = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(doc, dict) and isinstance(doc.get("input"), str):
        return doc["input"]
    return arguments


def custom_arguments(text: str) -> str:
    """The chat arguments of a custom tool call the client hands back: serialized as the
    common tool-call parsers of SGLang and vLLM serialize a parsed call (`json.dumps`, not
    ASCII-escaped). A model that wrote other whitespace is matched by meaning downstream."""
    return json.dumps({"input": text}, ensure_ascii=False)


def _string(tool: dict[str, Any], key: str, p: str, required: bool) -> str | None:
    value = tool.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        what = "a non-empty string" if required else "a string"
        raise invalid(f"{p}.{key}", f"'{p}.{key}' must be {what}.")
    return value


def _function(tool: dict[str, Any], p: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(name, chat function, echo) of a function tool."""
    name = _string(tool, "name", p, True)
    assert name is not None
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise invalid(f"{p}.parameters", f"'{p}.parameters' must be a JSON schema object.")
    desc = _string(tool, "description", p, False)
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{p}.strict", f"'{p}.strict' must be a boolean.")
    fn: dict[str, Any] = {"name": name}
    if desc is not None:
        fn["description"] = desc
    if params is not None:
        fn["parameters"] = params
    if strict is not None:
        fn["strict"] = strict
    echo = {
        "type": "function",
        "name": name,
        "description": desc,
        "parameters": params,
        "strict": strict,
    }
    return name, fn, echo


def _custom(tool: dict[str, Any], p: str, left_out: LeftOut) -> tuple[str, dict[str, Any]]:
    """(name, chat function) of a custom (freeform) tool."""
    name = _string(tool, "name", p, True)
    assert name is not None
    desc = _string(tool, "description", p, False)
    about = "The tool's whole input, as free text."
    fmt = tool.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise invalid(f"{p}.format", f"'{p}.format' must be an object.")
        kind = fmt.get("type")
        if kind == "grammar":
            syntax = fmt.get("syntax")
            definition = fmt.get("definition")
            if not isinstance(definition, str) or not isinstance(syntax, str):
                raise invalid(
                    f"{p}.format",
                    f"'{p}.format' of type 'grammar' needs string 'syntax' and 'definition'.",
                )
            about = f"The tool's whole input. It must follow this {syntax} grammar:\n{definition}"
            left_out.add(
                f"{p}.format",
                "custom_tool_grammar",
                "the grammar is given to the model in the tool's description; areal cannot "
                "constrain decoding to it",
            )
        elif kind != "text":
            raise invalid(
                f"{p}.format.type",
                f"'{p}.format.type' must be 'text' or 'grammar'.",
                "invalid_value",
            )
    fn: dict[str, Any] = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": about}},
            "required": ["input"],
            "additionalProperties": False,
        },
    }
    if desc is not None:
        fn["description"] = desc
    return name, fn


def _left_out(kind: Any, p: str, left_out: LeftOut) -> None:
    if not isinstance(kind, str):
        raise invalid(f"{p}.type", f"'{p}.type' must be a string.")
    what = f"tool.{kind}" if kind in HOSTED else "tool.other"
    left_out.add(
        p,
        what,
        f"tool type {kind!r}: a hosted or built-in tool has no schema a chat template "
        "takes; areal gives the model function, namespace and custom tools only",
    )


def parse_tools(raw: Any, left_out: LeftOut) -> Tools:
    if not isinstance(raw, list):
        raise invalid("tools", "'tools' must be an array.")
    out = Tools()
    # (chat function, client ref, param) in declaration order; names are settled after all
    # top-level names are known (an inner name yields to a top-level one).
    declared: list[tuple[dict[str, Any], ToolRef, str]] = []
    for i, tool in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(p, f"'{p}' must be an object.")
        kind = tool.get("type")
        if kind == "function":
            name, fn, echo = _function(tool, p)
            declared.append((fn, ToolRef(name), p))
            out.echo.append(echo)
        elif kind == "custom":
            name, fn = _custom(tool, p, left_out)
            declared.append((fn, ToolRef(name, custom=True), p))
            out.echo.append(tool)
        elif kind == "namespace":
            ns = _string(tool, "name", p, True)
            assert ns is not None
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{p}.tools", f"'{p}.tools' must be an array of tools.")
            for j, sub in enumerate(inner):
                q = f"{p}.tools[{j}]"
                if not isinstance(sub, dict):
                    raise invalid(q, f"'{q}' must be an object.")
                sub_kind = sub.get("type", "function")
                if sub_kind == "function":
                    name, fn, _ = _function(sub, q)
                    declared.append((fn, ToolRef(name, ns), q))
                elif sub_kind == "custom":
                    name, fn = _custom(sub, q, left_out)
                    declared.append((fn, ToolRef(name, ns, custom=True), q))
                else:
                    _left_out(sub_kind, q, left_out)
            out.echo.append(tool)
        else:
            _left_out(kind, p, left_out)

    top = {ref.name for _, ref, _ in declared if ref.namespace is None}
    inner_counts: dict[str, int] = {}
    for _, ref, _ in declared:
        if ref.namespace is not None:
            inner_counts[ref.name] = inner_counts.get(ref.name, 0) + 1
    for fn, ref, p in declared:
        name = ref.name
        if ref.namespace is not None and (name in top or inner_counts[name] > 1):
            name = f"{ref.namespace}{NAMESPACE_JOIN}{ref.name}"
        if name in out.by_chat:
            raise invalid(
                f"{p}.name",
                f"Tool name {name!r} is declared twice (namespaced tools whose names collide "
                f"are called '<namespace>{NAMESPACE_JOIN}<name>'); rename one of them.",
                "invalid_value",
            )
        fn["name"] = name
        out.chat.append({"type": "function", "function": fn})
        out.by_chat[name] = ref
        out.by_client[(ref.namespace, ref.name)] = name
    return out


def parse_tool_choice(raw: Any, tools: Tools) -> Any:
    """The chat `tool_choice` for a Responses one."""
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise invalid(
                "tool_choice",
                "'tool_choice' must be 'none', 'auto' or 'required'.",
                "invalid_value",
            )
        return raw
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind in ("function", "custom"):
            name = raw.get("name")
            if not isinstance(name, str) or not name:
                raise invalid("tool_choice.name", "'tool_choice.name' must be a string.")
            namespace = raw.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise invalid("tool_choice.namespace", "'tool_choice.namespace' must be a string.")
            return {"type": "function", "function": {"name": tools.chat_name(name, namespace)}}
        raise unsupported(
            "tool_choice",
            f"'tool_choice' of type {kind!r} is not supported: areal runs no hosted tools "
            "(only 'function' and 'custom').",
        )
    raise invalid("tool_choice", "'tool_choice' must be a string or an object.")
