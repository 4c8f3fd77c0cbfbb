"""A Messages API request -> the chat-completions body the proxy takes.

What is translated (docs/services.md, "Anthropic Messages API", has the tables):

- `system` (a string or text blocks) -> a first `system` message; `messages`: a user turn's
  `tool_result` blocks -> `tool` messages (in order, before the turn's text), its text blocks
  -> one `user` message; an assistant turn's `thinking`, `text` and `tool_use` blocks -> one
  assistant message (`reasoning_content`, `content`, `tool_calls`), as the model produced it;
- `max_tokens` (required), `temperature`, `top_p`, `top_k`, `stop_sequences` -> `stop`;
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` `auto` /
  `any` / `tool` / `none` -> `auto` / `required` / a named function / `none`, and
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`;
- `thinking` `enabled` / `disabled` -> `chat_template_kwargs.enable_thinking` (what
  reasoning templates read; others ignore it); `output_config.format` -> `response_format`.

Whatever areal cannot honour is a 400 naming the field and why (images, documents, server
tools, prefill, ...); `metadata.user_id`, `service_tier`, `cache_control` (the engine's prefix
cache is automatic) change no output and are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_gateway.anthropic.conversation import (
    content_blocks,
    string_field,
    text_of_blocks,
    to_messages,
)
from areal_gateway.anthropic.errors import invalid, unsupported
from areal_runtime.openai import read_head

# The proxy's limit on `stop` (areal_runtime.openai.fields.MAX_STOP).
MAX_STOP_SEQUENCES = 4

# Accepted: acted on, or by Anthropic's own definition changing no output.
_KNOWN = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stream",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "metadata",
        "service_tier",
        "cache_control",
        "output_config",
        "inference_geo",
        "speed",
    }
)
# Known to Anthropic, refused here, and why.
_REFUSED = {
    "container": "areal runs no code-execution containers",
    "mcp_servers": "areal connects to no MCP servers (define their tools as custom tools)",
    "context_management": "areal edits no context; send the conversation you want answered",
    "diagnostics": "areal has no diagnostics to return",
}
# Content blocks only Anthropic's servers can fill or read, refused with this reason.


@dataclass(slots=True)
class Translated:
    """The chat body for the generation path, and what the Messages answer needs."""

    chat: dict[str, Any]
    model: str
    stream: bool
    stop_sequences: list[str] = field(default_factory=list)


# --- tools --------------------------------------------------------------------------------

_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise invalid("tools", "must be an array of tools")
    out = []
    for i, tool in enumerate(raw):
        p = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(p, "a tool must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise unsupported(
                f"{p}.type",
                f"tool type {kind!r} is not supported: areal runs no server tools and knows "
                "no built-in tool's schema; define it as a custom tool with an input_schema",
            )
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
            if not isinstance(tool["strict"], bool):
                raise invalid(f"{p}.strict", "must be a boolean")
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any, names: set[str], chat: dict[str, Any]) -> None:
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
        if name not in names:
            raise invalid("tool_choice.name", f"no tool named {name!r} in 'tools'")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise invalid("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    if kind in ("any", "tool") and not names:
        raise invalid("tool_choice", f"tool_choice {kind!r} needs 'tools'")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise invalid("tool_choice.disable_parallel_tool_use", "must be a boolean")
        if disable:
            chat["parallel_tool_calls"] = False
    if names:
        chat["tool_choice"] = choice


# --- the request --------------------------------------------------------------------------


def _number(doc: dict[str, Any], key: str, hi: float) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(key, "must be a number")
    if not 0 <= v <= hi:
        raise invalid(key, f"must be between 0 and {hi:g}")
    return v


def _int(doc: dict[str, Any], key: str, lo: int) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(key, "must be an integer")
    if v < lo:
        raise invalid(key, f"must be at least {lo}")
    return v


def _system(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    return text_of_blocks(content_blocks(raw, "system"), "system", "'system'")


def _stop_sequences(raw: Any) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise invalid("stop_sequences", "must be an array of non-empty strings")
    if len(raw) > MAX_STOP_SEQUENCES:
        raise unsupported(
            "stop_sequences",
            f"areal takes at most {MAX_STOP_SEQUENCES} stop sequences, got {len(raw)}",
        )
    return raw


def _thinking(raw: Any, chat: dict[str, Any]) -> None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise invalid("thinking", "must be an object with a 'type'")
    kind = raw["type"]
    if kind == "enabled":
        _int(raw, "budget_tokens", 1)
        chat["chat_template_kwargs"] = {"enable_thinking": True}
    elif kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind not in ("adaptive", "between_tools"):
        raise invalid("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")


def _output_config(raw: Any, chat: dict[str, Any]) -> None:
    if not isinstance(raw, dict):
        raise invalid("output_config", "must be an object")
    for key, value in raw.items():
        if value is None:
            continue
        if key != "format":
            raise unsupported(f"output_config.{key}", "is not supported by areal")
        if not isinstance(value, dict) or value.get("type") != "json_schema":
            raise invalid("output_config.format", "must be {'type': 'json_schema', 'schema': ...}")
        schema = value.get("schema")
        if not isinstance(schema, dict):
            raise invalid("output_config.format.schema", "must be a JSON schema object")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True},
        }


def _refuse_unhonoured(doc: dict[str, Any]) -> None:
    for key, value in doc.items():
        if value is None or key in _KNOWN:
            continue
        why = _REFUSED.get(key)
        if why is not None:
            raise unsupported(key, f"is not supported ({why})")
        raise unsupported(key, "Extra inputs are not permitted (not a parameter areal honours)")
    if doc.get("speed") not in (None, "standard"):
        raise unsupported("speed", "only 'standard' is supported")
    metadata = doc.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid("metadata", "must be an object")
        for key, value in metadata.items():
            if key != "user_id":
                raise invalid(f"metadata.{key}", "Extra inputs are not permitted")
            if value is not None and not isinstance(value, str):
                raise invalid("metadata.user_id", "must be a string")


def translate(doc: dict[str, Any]) -> Translated:
    """Check a Messages body and translate it to a chat body (or raise a 400)."""
    head = read_head(doc)
    _refuse_unhonoured(doc)
    max_tokens = _int(doc, "max_tokens", 1)
    if max_tokens is None:
        raise invalid("max_tokens", "Field required")
    messages = to_messages(doc.get("messages"))
    if doc.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _system(doc["system"])})
    chat: dict[str, Any] = {"model": head.model, "messages": messages, "max_tokens": max_tokens}
    if head.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key, hi in (("temperature", 1.0), ("top_p", 1.0)):
        v = _number(doc, key, hi)
        if v is not None:
            chat[key] = v
    top_k = _int(doc, "top_k", 0)
    if top_k is not None:
        chat["top_k"] = top_k
    stops: list[str] = []
    if doc.get("stop_sequences") is not None:
        stops = _stop_sequences(doc["stop_sequences"])
        if stops:
            chat["stop"] = stops
            # Which sequence stopped the answer is not in a chat answer; the generated
            # tokens are (their bytes run past the cut), so the answer's logprobs tell.
            chat["logprobs"] = True
    names: set[str] = set()
    if doc.get("tools") is not None:
        tools = _tools(doc["tools"])
        if tools:
            chat["tools"] = tools
            names = {t["function"]["name"] for t in tools}
    if doc.get("tool_choice") is not None:
        _tool_choice(doc["tool_choice"], names, chat)
    if doc.get("thinking") is not None:
        _thinking(doc["thinking"], chat)
    if doc.get("output_config") is not None:
        _output_config(doc["output_config"], chat)
    return Translated(chat=chat, model=head.model, stream=head.stream, stop_sequences=stops)
