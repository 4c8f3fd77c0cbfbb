"""A Responses API request -> a chat-completions body (and what its response echoes).

The inference gateway serves `POST /v1/responses` as a translation: the request becomes the
chat body the chat endpoint would get, and goes down the chat generation path unchanged (so a
session key records it exactly like a chat). What is translated:

- `input` (a string, or a list of items: messages with `input_text` / `output_text` /
  `refusal` parts, `function_call`, `function_call_output`, `reasoning`) -> `messages`; an
  assistant's reasoning, text and function calls of one turn become one assistant message
  (`reasoning_content`, `content`, `tool_calls`), as the model produced them;
- `instructions` -> a first `system` message (not carried along a `previous_response_id`
  chain, as OpenAI does);
- `previous_response_id` -> the conversation stored for that response, then `input`;
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `parallel_tool_calls` as
  they are; `top_logprobs` and `include: ["message.output_text.logprobs"]` -> `logprobs`;
- function `tools` (flat `{"type": "function", "name", "parameters", "strict"}`) -> chat
  tools; `tool_choice` (`none` / `auto` / `required` / `{"type": "function", "name"}`);
- `text.format` (`json_schema`, `json_object`) -> `response_format`.

Everything else areal does not honour is a 400 `unsupported_parameter` naming it (built-in
tools, `background`, `conversation`, `prompt`, `include` values it cannot supply, image or
file inputs, unknown fields); purely informational fields (`metadata`, `user`, `store`,
`safety_identifier`, `prompt_cache_key`, `service_tier: auto|default`) are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_gateway.openai.errors import bad_request
from areal_runtime.errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20

# Accepted and acted on, or purely informational.
_KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "stream",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "previous_response_id",
        "store",
        "metadata",
        "user",
        "text",
        "include",
        "top_logprobs",
        "truncation",
        "reasoning",
        "background",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "stream_options",
    }
)
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def unsupported(param: str, message: str) -> InvalidRequest:
    return bad_request(message, code="unsupported_parameter", param=param)


def _invalid(param: str, message: str, code: str = "invalid_type") -> InvalidRequest:
    return bad_request(message, code=code, param=param)


@dataclass(slots=True)
class Translated:
    """The chat body for the generation path, and what the Responses answer needs."""

    chat: dict[str, Any]
    # The conversation this request adds to a chain (without `instructions`): the previous
    # response's conversation and output, then this request's input items.
    history: list[dict[str, Any]]
    # This request's own input items (what a stored response keeps besides its output).
    inputs: list[dict[str, Any]]
    echo: dict[str, Any]
    metadata: dict[str, Any]
    previous_response_id: str | None
    store: bool
    logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


# --- input items -> messages --------------------------------------------------------------


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


def normalize_input(raw: Any) -> list[dict[str, Any]]:
    """`input` as a list of checked items (a string is one user message)."""
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
                    "name": _string(item, "name", p),
                    "arguments": args,
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{p}.output")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": _string(item, "call_id", p),
                    "output": text,
                }
            )
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise unsupported(
                    f"{p}.encrypted_content",
                    "Encrypted reasoning is not supported; pass the reasoning text back.",
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


def output_to_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items, as the input items that continue its conversation."""
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
        elif kind == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return items


# --- tools, tool choice, text format ------------------------------------------------------


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat tools, the tools as the response echoes them)."""
    if not isinstance(raw, list):
        raise _invalid("tools", "'tools' must be an array.")
    chat, echo = [], []
    for i, tool in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(p, f"'{p}' must be an object.")
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(
                f"{p}.type",
                f"Tool type {kind!r} is not supported: areal runs no built-in tools; "
                "only function tools.",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{p}.name", f"'{p}.name' must be a non-empty string.")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _invalid(f"{p}.parameters", f"'{p}.parameters' must be a JSON schema object.")
        desc = tool.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _invalid(f"{p}.description", f"'{p}.description' must be a string.")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid(f"{p}.strict", f"'{p}.strict' must be a boolean.")
        fn: dict[str, Any] = {"name": name}
        if desc is not None:
            fn["description"] = desc
        if params is not None:
            fn["parameters"] = params
        if strict is not None:
            fn["strict"] = strict
        chat.append({"type": "function", "function": fn})
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": desc,
                "parameters": params,
                "strict": strict,
            }
        )
    return chat, echo


def _tool_choice(raw: Any) -> Any:
    """The chat `tool_choice` for a Responses one."""
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise _invalid(
                "tool_choice",
                "'tool_choice' must be 'none', 'auto' or 'required'.",
                "invalid_value",
            )
        return raw
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "function":
            name = raw.get("name")
            if not isinstance(name, str) or not name:
                raise _invalid("tool_choice.name", "'tool_choice.name' must be a string.")
            return {"type": "function", "function": {"name": name}}
        raise unsupported(
            "tool_choice", f"'tool_choice' of type {kind!r} is not supported (only 'function')."
        )
    raise _invalid("tool_choice", "'tool_choice' must be a string or an object.")


def _text(raw: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat `response_format` or None, the `text` the response echoes)."""
    if not isinstance(raw, dict):
        raise _invalid("text", "'text' must be an object.")
    for key in raw:
        if key not in ("format", "verbosity"):
            raise unsupported(f"text.{key}", f"'text.{key}' is not supported.")
    verbosity = raw.get("verbosity")
    if verbosity not in (None, "medium"):
        raise unsupported(
            "text.verbosity", "'text.verbosity' other than 'medium' is not supported."
        )
    fmt = raw.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(fmt, dict):
        raise _invalid("text.format", "'text.format' must be an object.")
    kind = fmt.get("type")
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}}
    if kind == "json_schema":
        name = fmt.get("name")
        schema = fmt.get("schema")
        if not isinstance(name, str) or not name:
            raise _invalid("text.format.name", "'text.format.name' must be a non-empty string.")
        if not isinstance(schema, dict):
            raise _invalid("text.format.schema", "'text.format.schema' must be a JSON schema.")
        spec: dict[str, Any] = {"name": name, "schema": schema}
        for key in ("strict", "description"):
            if fmt.get(key) is not None:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}, {
            "format": {"type": "json_schema", **spec}
        }
    raise _invalid(
        "text.format.type",
        "'text.format.type' must be 'text', 'json_object' or 'json_schema'.",
        "invalid_value",
    )


# --- the request --------------------------------------------------------------------------


def _number(doc: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _invalid(key, f"'{key}' must be a number.")
    if not lo <= v <= hi:
        raise _invalid(key, f"'{key}' must be between {lo:g} and {hi:g}.", "invalid_value")
    return v


def refuse_unhonoured(doc: dict[str, Any]) -> None:
    for key, value in doc.items():
        # null is "not given" in the OpenAI API: nothing asked, so nothing ignored.
        if key not in _KNOWN and value is not None:
            raise unsupported(key, f"Parameter '{key}' is not supported by areal.")
    if doc.get("background"):
        raise unsupported("background", "Background responses are not supported.")
    truncation = doc.get("truncation")
    if truncation not in (None, "disabled"):
        raise unsupported("truncation", "Only 'truncation': 'disabled' is supported.")
    tier = doc.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"'service_tier' {tier!r} is not supported.")
    reasoning = doc.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _invalid("reasoning", "'reasoning' must be an object.")
        for key, value in reasoning.items():
            if value is not None:
                raise unsupported(
                    f"reasoning.{key}",
                    f"'reasoning.{key}' is not supported (the model reasons as its chat "
                    "template and reasoning parser say).",
                )
    opts = doc.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _invalid("stream_options", "'stream_options' must be an object.")
        for key, value in opts.items():
            if key != "include_obfuscation" or value:
                raise unsupported(
                    f"stream_options.{key}", f"'stream_options.{key}' is not supported."
                )


def translate(
    doc: dict[str, Any],
    model: str,
    stream: bool,
    lookup: Callable[[str], list[dict[str, Any]]] | None = None,
) -> Translated:
    """Check and translate a Responses body; `lookup` gives the stored conversation of a
    `previous_response_id` (or raises)."""
    refuse_unhonoured(doc)
    previous = previous_id(doc)
    history: list[dict[str, Any]] | None = None
    if previous is not None:
        if lookup is None:
            raise unsupported("previous_response_id", "'previous_response_id' is not supported.")
        history = lookup(previous)
    raw_input = doc.get("input")
    if raw_input is None:
        if history is None:
            raise bad_request(
                "Missing required parameter: 'input'.",
                code="missing_required_parameter",
                param="input",
            )
        items: list[dict[str, Any]] = []
    else:
        items = normalize_input(raw_input)
    conversation = [*(history or ()), *items]
    if not conversation:
        raise _invalid("input", "'input' must not be empty.", "empty_array")
    messages = to_messages(conversation)
    instructions = doc.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _invalid("instructions", "'instructions' must be a string.")
        messages.insert(0, {"role": "system", "content": instructions})

    chat: dict[str, Any] = {"model": model, "messages": messages}
    echo: dict[str, Any] = {"instructions": instructions}
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    max_out = doc.get("max_output_tokens")
    if max_out is not None:
        if isinstance(max_out, bool) or not isinstance(max_out, int):
            raise _invalid("max_output_tokens", "'max_output_tokens' must be an integer.")
        if max_out < 1:
            raise _invalid(
                "max_output_tokens", "'max_output_tokens' must be at least 1.", "invalid_value"
            )
        chat["max_tokens"] = max_out
    echo["max_output_tokens"] = max_out
    for key, hi in (("temperature", 2.0), ("top_p", 1.0)):
        v = _number(doc, key, 0.0, hi)
        if v is not None:
            chat[key] = v
        echo[key] = v
    if doc.get("tools") is not None:
        chat_tools, echo["tools"] = _tools(doc["tools"])
        if chat_tools:
            chat["tools"] = chat_tools
    if doc.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(doc["tool_choice"])
        echo["tool_choice"] = doc["tool_choice"]
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
        chat["parallel_tool_calls"] = parallel
        echo["parallel_tool_calls"] = parallel
    if doc.get("text") is not None:
        fmt, echo["text"] = _text(doc["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    include = doc.get("include")
    logprobs = False
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise _invalid("include", "'include' must be an array of strings.")
        for j, value in enumerate(include):
            if value != LOGPROBS_INCLUDE:
                raise unsupported(f"include[{j}]", f"'include' value {value!r} is not supported.")
        logprobs = bool(include)
    top = doc.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _invalid(
                "top_logprobs",
                f"'top_logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}.",
            )
        if top:
            logprobs = True
            chat["top_logprobs"] = top
    if logprobs:
        chat["logprobs"] = True
    echo["top_logprobs"] = top
    store = doc.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise _invalid("store", "'store' must be a boolean.")
    echo["store"] = store
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid("user", "'user' must be a string.")
    echo["user"] = user
    if doc.get("service_tier") is not None:
        echo["service_tier"] = "default"
    metadata = doc.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise _invalid("metadata", "'metadata' must be an object.")
    return Translated(
        chat=chat,
        history=conversation,
        inputs=items,
        echo=echo,
        metadata=metadata,
        previous_response_id=previous,
        store=store,
        logprobs=logprobs,
    )


def previous_id(doc: dict[str, Any]) -> str | None:
    previous = doc.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _invalid("previous_response_id", "'previous_response_id' must be a string.")
    return previous
