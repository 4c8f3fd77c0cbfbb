"""Messages API turns -> chat messages: content blocks checked and translated.

A user turn's `tool_result` blocks become `tool` messages (in order, before the turn's text),
its text blocks one `user` message; an assistant turn's `thinking`, `text` and `tool_use`
blocks become one assistant message (`reasoning_content`, `content`, `tool_calls`), as the
model produced it; a `system` message (Claude Code sends one after its first user turn) a
chat `system` message in place. A tool result with `is_error: true` reads as an error to the
model: its text starts with "Error: " (unless it already starts with "error", any case).
Blocks only Anthropic's servers can fill or read, and non-text media, are a 400 naming the
block and why.
"""

from __future__ import annotations

import json
from typing import Any

from areal_gateway.anthropic import tool_reference
from areal_gateway.anthropic.errors import invalid, unsupported

_NOT_TEXT = "this model takes text only"
_SERVER_BLOCK = "areal runs no server tools"
_REFUSED_BLOCKS = {
    "image": _NOT_TEXT,
    "document": _NOT_TEXT,
    "search_result": _NOT_TEXT,
    "container_upload": "areal runs no code-execution containers",
    "redacted_thinking": "areal cannot read encrypted thinking",
}


def string_field(value: Any, path: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise invalid(path, "must be a non-empty string" if not empty else "must be a string")
    return value


def content_blocks(content: Any, path: str) -> list[dict[str, Any]]:
    """`content` as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(path, "must be a string or an array of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid(f"{path}.{j}", "a content block must be an object with a string 'type'")
        kind = block["type"]
        if kind in _REFUSED_BLOCKS:
            raise unsupported(
                f"{path}.{j}.type",
                f"content blocks of type {kind!r} are not supported ({_REFUSED_BLOCKS[kind]})",
            )
        if kind == "server_tool_use" or (kind.endswith("_tool_result") and kind != "tool_result"):
            raise unsupported(
                f"{path}.{j}.type",
                f"content blocks of type {kind!r} are not supported ({_SERVER_BLOCK})",
            )
    return content


def _text_of(block: dict[str, Any], path: str) -> str:
    if block.get("citations"):
        raise unsupported(f"{path}.citations", "citations are not supported")
    return string_field(block.get("text"), f"{path}.text")


def text_of_blocks(blocks: list[dict[str, Any]], path: str, what: str) -> str:
    """The text of text-only blocks (`system`, a tool result), joined as the chat parser joins
    content parts."""
    texts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text":
            raise invalid(
                f"{path}.{j}.type", f"{what} takes text blocks only, not {block['type']!r}"
            )
        texts.append(_text_of(block, f"{path}.{j}"))
    return "\n".join(texts)


def _tool_input_json(value: Any, path: str) -> str:
    if not isinstance(value, dict):
        raise invalid(path, "must be an object")
    # As the proxy's tool parsers write arguments (json.dumps, default separators, unicode as
    # is): the assistant message echoed back then reads exactly as the one the proxy recorded,
    # so the session's lineage links the turns.
    return json.dumps(value, ensure_ascii=False)


def _assistant(blocks: list[dict[str, Any]], path: str) -> tuple[dict[str, Any], set[str]]:
    """One assistant turn -> one chat message, and its tool_use ids."""
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        p = f"{path}.{j}"
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(block, p))
        elif kind == "thinking":
            thinking.append(string_field(block.get("thinking"), f"{p}.thinking"))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": string_field(block.get("id"), f"{p}.id", empty=False),
                    "type": "function",
                    "function": {
                        "name": string_field(block.get("name"), f"{p}.name", empty=False),
                        "arguments": _tool_input_json(block.get("input"), f"{p}.input"),
                    },
                }
            )
        elif kind == "tool_result":
            raise invalid(f"{p}.type", "tool_result blocks belong in a user message")
        else:
            raise invalid(
                f"{p}.type",
                f"unknown content block type {kind!r} for an assistant message (expected text, thinking or tool_use)",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg, {c["id"] for c in calls}


ERROR_PREFIX = "Error: "


def error_text(content: str) -> str:
    """A failed tool's result as the model reads it. A chat template's tool message has no
    error flag, so the text says it, the way tools' own errors usually read; a result that
    already starts with "error" says it already. The same result renders the same on every
    turn, so the recorded prompt stays what the next turn continues."""
    if content.lstrip()[:5].lower() == "error":
        return content
    return ERROR_PREFIX + content if content else ERROR_PREFIX.rstrip(": ")


def _tool_result_text(content: Any, path: str, tools: dict[str, dict[str, Any]]) -> str:
    """A tool result's text: its text blocks, then the tools its `tool_reference` blocks
    load (tool_reference.py)."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    refs: list[tuple[str, str]] = []
    for j, b in enumerate(content_blocks(content, path)):
        at = f"{path}.{j}"
        if b["type"] == "text":
            texts.append(_text_of(b, at))
        elif b["type"] == "tool_reference":
            refs.append((string_field(b.get("tool_name"), f"{at}.tool_name", empty=False), at))
        else:
            raise invalid(
                f"{at}.type",
                f"a tool result takes text and tool_reference blocks only, not {b['type']!r}",
            )
    text = "\n".join(texts)
    if not refs:
        return text
    loaded = tool_reference.expand(refs, tools)
    return f"{text}\n{loaded}" if text else loaded


def _user(
    blocks: list[dict[str, Any]],
    path: str,
    open_calls: set[str],
    tools: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """One user turn -> its tool results as `tool` messages, then its text as a user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        p = f"{path}.{j}"
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(block, p))
        elif kind == "tool_result":
            if texts:
                raise invalid(p, "tool_result blocks must come before any text in a user message")
            tid = string_field(block.get("tool_use_id"), f"{p}.tool_use_id", empty=False)
            if tid not in open_calls:
                raise invalid(
                    f"{p}.tool_use_id",
                    f"{tid!r} answers no tool_use block of the assistant message just before",
                )
            content = _tool_result_text(block.get("content", ""), f"{p}.content", tools)
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise invalid(f"{p}.is_error", "must be a boolean")
            if is_error:
                content = error_text(content)
            out.append({"role": "tool", "tool_call_id": tid, "content": content})
        elif kind in ("tool_use", "thinking"):
            raise invalid(f"{p}.type", f"{kind} blocks belong in an assistant message")
        else:
            raise invalid(
                f"{p}.type",
                f"unknown content block type {kind!r} for a user message (expected text or tool_result)",
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def to_messages(raw: Any, tools: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat messages of `messages`; `tools`: the request's custom tools by name (their
    chat `function`), deferred ones included, which `tool_reference` blocks may load."""
    if raw is None:
        raise invalid("messages", "Field required")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "must be a non-empty array of messages")
    messages: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # tool_use ids of the assistant turn just before
    for i, m in enumerate(raw):
        p = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(p, "a message must be an object")
        role = m.get("role")
        if "content" not in m:
            raise invalid(f"{p}.content", "Field required")
        blocks = content_blocks(m["content"], f"{p}.content")
        if role == "user":
            messages.extend(_user(blocks, f"{p}.content", open_calls, tools or {}))
            open_calls = set()
        elif role == "assistant":
            msg, open_calls = _assistant(blocks, f"{p}.content")
            messages.append(msg)
        elif role == "system":
            # In place: where the harness put it is what the model reads (the chat template
            # decides how; one that refuses a system message after the first is a 400 from
            # the proxy, `chat_template_error`). A tool_use before it still awaits its result.
            messages.append(
                {
                    "role": "system",
                    "content": text_of_blocks(blocks, f"{p}.content", "a system message"),
                }
            )
        else:
            raise invalid(f"{p}.role", f"must be 'user', 'assistant' or 'system', not {role!r}")
    last = _last_turn(raw)
    if last is None:
        raise invalid("messages", "needs a user message to answer (only system messages sent)")
    if raw[last].get("role") != "user":
        raise invalid(
            f"messages.{last}.role",
            "the last message other than system messages must be a user message: areal does "
            "not continue a partial assistant message (prefill: a recorded turn must be what "
            "the model sampled from the prompt); end with the user turn to be answered",
        )
    return messages


def _last_turn(raw: list[Any]) -> int | None:
    """The index of the last message that is not a `system` message."""
    for i in range(len(raw) - 1, -1, -1):
        if raw[i].get("role") != "system":
            return i
    return None
