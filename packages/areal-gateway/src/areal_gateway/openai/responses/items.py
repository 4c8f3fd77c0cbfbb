"""Responses input items -> the chat conversation, and a response's output back into items.

Items are checked and normalized once (`normalize_input`) into the shape the conversation
holds and a stored response keeps: `message` (role, text), `reasoning` (text),
`function_call` (call id, the chat function's name, the arguments string) and
`function_call_output` (call id, text). A custom tool's call and output are a function's
(tools.py), so a stored turn and a client's resent one are the same chat call. `to_messages`
makes the chat messages of them: one assistant turn (reasoning, text, calls) is one
assistant message, as the model produced it.
"""

from __future__ import annotations

from typing import Any

from areal_gateway.openai.responses.tools import Tools, custom_arguments, unsupported
from areal_gateway.openai.responses.tools import invalid as _invalid

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, f"'{param}' must be a string or an array of content parts.")
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _invalid(p, f"'{p}' must be an object.")
        kind = part.get("type")
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            if isinstance(kind, str) and kind.startswith("input_"):
                raise unsupported(
                    f"{p}.type", f"Content part type {kind!r} is not supported (text only)."
                )
            raise _invalid(f"{p}.type", f"Unknown content part type {kind!r}.", "invalid_value")
        text = part.get(key)
        if not isinstance(text, str):
            raise _invalid(f"{p}.{key}", f"'{p}.{key}' must be a string.")
        texts.append(text)
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise _invalid(f"{param}.{key}", f"'{param}.{key}' must be a non-empty string.")
    return value


def _call_name(item: dict[str, Any], p: str, tools: Tools) -> str:
    """The chat name of a call the client hands back (tools.py)."""
    name = _string(item, "name", p)
    assert name is not None
    namespace = _string(item, "namespace", p, required=False)
    return tools.chat_name(name, namespace)


def _output_text(item: dict[str, Any], p: str) -> str:
    output = item.get("output")
    return output if isinstance(output, str) else _parts_text(output, f"{p}.output")


def normalize_input(raw: Any, tools: Tools | None = None) -> list[dict[str, Any]]:
    """`input` as a list of checked items (a string is one user message), each as the chat
    conversation holds it: a call names the chat function the model called (`tools`, the
    request's), and a custom tool's call and output are a function's."""
    if tools is None:
        tools = Tools()
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _invalid("input", "'input' must be a string or an array of input items.")
    items: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise _invalid(p, f"'{p}' must be an object.")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _invalid(
                    f"{p}.role",
                    f"'{p}.role' must be one of {', '.join(sorted(_ROLES))}.",
                    "invalid_value",
                )
            text = _parts_text(item.get("content"), f"{p}.content")
            # A developer message is a system message to a chat template.
            role = "system" if role == "developer" else role
            items.append({"type": "message", "role": role, "content": text})
        elif kind == "function_call":
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise _invalid(f"{p}.arguments", f"'{p}.arguments' must be a JSON string.")
            items.append(
                {
                    "type": "function_call",
                    "call_id": _string(item, "call_id", p),
                    "name": _call_name(item, p, tools),
                    "arguments": args,
                }
            )
        elif kind == "custom_tool_call":
            given = item.get("input")
            if not isinstance(given, str):
                raise _invalid(f"{p}.input", f"'{p}.input' must be a string.")
            items.append(
                {
                    "type": "function_call",
                    "call_id": _string(item, "call_id", p),
                    "name": _call_name(item, p, tools),
                    "arguments": custom_arguments(given),
                }
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": _string(item, "call_id", p),
                    "output": _output_text(item, p),
                }
            )
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise unsupported(
                    f"{p}.encrypted_content",
                    "Encrypted reasoning areal did not write cannot be continued (areal writes "
                    "none: its reasoning items carry 'encrypted_content': null); pass the "
                    "reasoning text back as 'content' or 'summary'.",
                )
            content = item.get("content")
            if content:
                text = _reasoning_text(content, f"{p}.content", "reasoning_text")
            else:
                text = _reasoning_text(item.get("summary") or [], f"{p}.summary", "summary_text")
            items.append({"type": "reasoning", "text": text})
        else:
            raise unsupported(f"{p}.type", f"Input items of type {kind!r} are not supported.")
    return items


def _reasoning_text(parts: Any, param: str, kind: str) -> str:
    if not isinstance(parts, list):
        raise _invalid(param, f"'{param}' must be an array.")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise _invalid(f"{param}[{j}]", f"'{param}[{j}]' must be a {kind} part with 'text'.")
        texts.append(part["text"])
    return "\n".join(texts)


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked items -> chat messages. One assistant turn (reasoning, text, calls, in that
    order as a model emits them) is one assistant message."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def assistant(stage: int) -> dict[str, Any]:
        # stage: 0 reasoning, 1 text, 2 calls; a turn never goes back to an earlier stage.
        nonlocal turn
        if turn is None or turn["_stage"] > stage or (stage < 2 and turn["_stage"] == stage):
            turn = {"role": "assistant", "content": None, "_stage": stage}
            messages.append(turn)
        turn["_stage"] = stage
        return turn

    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] == "assistant":
            assistant(1)["content"] = item["content"]
        elif kind == "reasoning":
            assistant(0)["reasoning_content"] = item["text"]
        elif kind == "function_call":
            msg = assistant(2)
            msg.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif kind == "function_call_output":
            turn = None
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            turn = None
            messages.append({"role": item["role"], "content": item["content"]})
    for m in messages:
        m.pop("_stage", None)
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""  # reasoning alone
    return messages


def output_to_items(
    output: list[dict[str, Any]], calls: dict[str, tuple[str, str]] | None = None
) -> list[dict[str, Any]]:
    """A response's output items, as the input items that continue its conversation.
    `calls`: item id -> (chat name, arguments) of each call as the model produced it
    (`ResponseBuilder.chat_calls`), so a chain continues the exact call."""
    calls = calls or {}
    items: list[dict[str, Any]] = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            text = "".join(
                p.get("text", "") for p in item.get("content", ()) if p.get("type") == "output_text"
            )
            items.append({"type": "message", "role": "assistant", "content": text})
        elif kind == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content", ()))
            items.append({"type": "reasoning", "text": text})
        elif kind in ("function_call", "custom_tool_call"):
            name, args = calls.get(item.get("id", ""), ("", ""))
            if not name:
                name = item["name"]
                args = (
                    item["arguments"]
                    if kind == "function_call"
                    else custom_arguments(item["input"])
                )
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": name,
                    "arguments": args,
                }
            )
    return items
