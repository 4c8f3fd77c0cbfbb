"""A Messages API request -> the chat-completions body the proxy takes.

What is translated (docs/services.md, "Anthropic Messages API", has the tables):

- `system` (a string or text blocks) -> a first `system` message; `messages`: a user turn's
  `tool_result` blocks -> `tool` messages (in order, before the turn's text), its text blocks
  -> one `user` message; an assistant turn's `thinking`, `text` and `tool_use` blocks -> one
  assistant message (`reasoning_content`, `content`, `tool_calls`), as the model produced it;
  a `system` message among them -> a chat `system` message in place (conversation.py);
- `max_tokens` (required), `temperature`, `top_p`, `top_k`, `stop_sequences` -> `stop`;
- `tools` and `tool_choice` (tools.py): custom tools -> function tools, deferred ones and
  server tools left out of the prompt;
- `thinking` `enabled` / `disabled` -> `chat_template_kwargs.enable_thinking` (what
  reasoning templates read; others ignore it), `output_config.effort` ->
  `chat_template_kwargs.reasoning_effort` (likewise); `output_config.format` ->
  `response_format`;
- `context_management`: accepted where its edits remove nothing (context_management.py).

What would change the recording or what areal cannot read is a 400 naming the field and why
(images, documents, prefill, encrypted thinking, ...); what areal truly cannot do but can
leave out of the prompt (server tools) is left out and reported (left_out.py);
`metadata.user_id`, `service_tier`, `cache_control` (the engine's prefix cache is
automatic), `thinking.display` change no output and are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_gateway.anthropic import context_management
from areal_gateway.anthropic.conversation import content_blocks, text_of_blocks, to_messages
from areal_gateway.anthropic.errors import invalid, unsupported
from areal_gateway.anthropic.tools import Tools, translate_tool_choice, translate_tools
from areal_gateway.left_out import LeftOut
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
        "context_management",
    }
)
# Known to Anthropic, refused here, and why.
_REFUSED = {
    "diagnostics": "areal has no diagnostics to return",
}
# Known to Anthropic, hosted by Anthropic: left out (with the server tools they serve), and why.
_LEFT_OUT = {
    "container": ("container", "areal runs no code-execution containers"),
    "mcp_servers": (
        "mcp_servers",
        "areal connects to no MCP servers (define their tools as custom tools to offer them)",
    ),
}
# `output_config.effort` values (Anthropic's), passed on as the template's reasoning effort.
EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})


@dataclass(slots=True)
class Translated:
    """The chat body for the generation path, and what the Messages answer needs."""

    chat: dict[str, Any]
    model: str
    stream: bool
    stop_sequences: list[str] = field(default_factory=list)
    # What was left out of the prompt (server tools, ...), said in the answer's header.
    left_out: LeftOut = field(default_factory=LeftOut)
    # The request had `context_management`: the answer says which edits applied (none).
    context_management: bool = False
    # Indices of the `system` messages inside `messages` (named if the template refuses one).
    system_at: list[int] = field(default_factory=list)


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


def _template_kwarg(chat: dict[str, Any], key: str, value: Any) -> None:
    chat.setdefault("chat_template_kwargs", {})[key] = value


def _thinking(raw: Any, chat: dict[str, Any]) -> None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise invalid("thinking", "must be an object with a 'type'")
    kind = raw["type"]
    if kind == "enabled":
        _int(raw, "budget_tokens", 1)
        _template_kwarg(chat, "enable_thinking", True)
    elif kind == "disabled":
        _template_kwarg(chat, "enable_thinking", False)
    elif kind not in ("adaptive", "between_tools"):
        raise invalid("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")
    # `display` ('summarized', 'omitted') says how much of the thinking Anthropic shows; areal
    # has no summarizer and no encrypted signature to carry hidden thinking to the next turn,
    # so it always answers the thinking in full: a client that echoes it back sends the
    # conversation the model saw, and the next prompt continues the recorded one.
    display = raw.get("display")
    if display is not None and not isinstance(display, str):
        raise invalid("thinking.display", "must be a string ('summarized' or 'omitted')")


def _output_config(raw: Any, chat: dict[str, Any]) -> None:
    if not isinstance(raw, dict):
        raise invalid("output_config", "must be an object")
    for key, value in raw.items():
        if value is None:
            continue
        if key == "effort":
            if value not in EFFORTS:
                raise invalid(
                    "output_config.effort", f"must be one of {', '.join(sorted(EFFORTS))}"
                )
            # What templates with an effort knob read (gpt-oss's `reasoning_effort`); a
            # template without one never reads it, so it changes nothing there.
            _template_kwarg(chat, "reasoning_effort", value)
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
        if value is None or key in _KNOWN or key in _LEFT_OUT:
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


def translate(doc: dict[str, Any], *, counting: bool = False) -> Translated:
    """Check a Messages body and translate it to a chat body (or raise a 400). `counting`:
    the body of `/v1/messages/count_tokens`, where `max_tokens` is not required and nothing
    streams."""
    head = read_head(doc)
    _refuse_unhonoured(doc)
    max_tokens = _int(doc, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise invalid("max_tokens", "Field required")
    if doc.get("context_management") is not None:
        context_management.check(doc["context_management"], doc.get("messages"))
    left_out = LeftOut()
    for key, (what, why) in _LEFT_OUT.items():
        if doc.get(key) is not None:
            left_out.add(key, what, why)
    tools = translate_tools(doc["tools"], left_out) if doc.get("tools") is not None else Tools()
    messages = to_messages(doc.get("messages"), tools.defined)
    if doc.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _system(doc["system"])})
    chat: dict[str, Any] = {"model": head.model, "messages": messages}
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    stream = head.stream and not counting
    if stream:
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
    if tools.chat:
        chat["tools"] = tools.chat
    if doc.get("tool_choice") is not None:
        names = {t["function"]["name"] for t in tools.chat}
        translate_tool_choice(doc["tool_choice"], names, tools.deferred, chat)
    if doc.get("thinking") is not None:
        _thinking(doc["thinking"], chat)
    if doc.get("output_config") is not None:
        _output_config(doc["output_config"], chat)
    return Translated(
        chat=chat,
        model=head.model,
        stream=stream,
        stop_sequences=stops,
        left_out=left_out,
        context_management=doc.get("context_management") is not None,
        system_at=[i for i, m in enumerate(doc["messages"]) if m.get("role") == "system"],
    )
