"""A Responses API request -> a chat-completions body (and what its response echoes).

The inference gateway serves `POST /v1/responses` as a translation: the request becomes the
chat body the chat endpoint would get, and goes down the chat generation path unchanged (so a
session key records it exactly like a chat). What is translated:

- `input` (a string, or a list of items: messages with `input_text` / `output_text` /
  `refusal` parts, `function_call`, `function_call_output`, `custom_tool_call`,
  `custom_tool_call_output`, `reasoning`) -> `messages` (items.py): an assistant's
  reasoning, text and tool calls of one turn become one assistant message
  (`reasoning_content`, `content`, `tool_calls`), as the model produced them; a call keeps
  its arguments string as it is, and names the chat function the model called (tools.py: a
  namespaced call its chat name, a custom call the function that stands for it);
- `instructions` -> a first `system` message (not carried along a `previous_response_id`
  chain, as OpenAI does);
- `previous_response_id` -> the conversation stored for that response, then `input`;
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `parallel_tool_calls` as
  they are; `top_logprobs` and `include: ["message.output_text.logprobs"]` -> `logprobs`;
- `tools` and `tool_choice`: tools.py (function, namespace and custom tools; hosted ones
  left out);
- `reasoning.effort` -> `chat_template_kwargs.reasoning_effort` (a template with that knob
  uses it, any other renders as without it); `reasoning.summary`: the reasoning item's
  summary (areal has no summarizer: the summary is the reasoning text itself);
- `include: ["reasoning.encrypted_content"]`: reasoning items carry `encrypted_content:
  null` (areal has no encrypted reasoning to give; the client hands the reasoning text back);
- `text.format` (`json_schema`, `json_object`) -> `response_format`.

Left out and reported (left_out.py: the `x-areal-left-out` header, a log line, a metric),
never refused, as each changes nothing areal samples: hosted tools, a `service_tier` other
than auto/default (areal has one), `text.verbosity` other than medium (no template has that
knob), and `include` values for hosted tools' outputs (areal runs none, so there are none).
Purely informational fields (`metadata`, `client_metadata`, `user`, `store`,
`safety_identifier`, `prompt_cache_key`) are accepted. Everything else areal does not honour
is a 400 `unsupported_parameter` naming it (`background`, `conversation`, `prompt`,
`truncation: auto`, unknown `include` values, image or file inputs, unknown fields), and so
is what would make the recording lie: encrypted reasoning on input (areal never wrote any).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_gateway.left_out import LeftOut
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.responses.items import normalize_input, to_messages
from areal_gateway.openai.responses.tools import (
    Tools,
    parse_tool_choice,
    parse_tools,
    unsupported,
)
from areal_gateway.openai.responses.tools import invalid as _invalid

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
# `include` values that ask for the outputs of hosted tools (or of image inputs): areal runs
# none and takes none, so there is never anything to include.
HOSTED_INCLUDES = frozenset(
    {
        "web_search_call.results",
        "web_search_call.action.sources",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
REASONING_SUMMARIES = frozenset({"auto", "concise", "detailed"})
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
        "client_metadata",
    }
)


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
    tools: Tools = field(default_factory=Tools)
    # The reasoning item's summary is its text (`reasoning.summary` asked for one).
    summary: bool = False
    # Reasoning items carry `encrypted_content: null` (`include` asked for it).
    encrypted_content: bool = False
    left_out: LeftOut = field(default_factory=LeftOut)


# --- text, reasoning, include ------------------------------------------------------------


def _text(raw: Any, left_out: LeftOut) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat `response_format` or None, the `text` the response echoes)."""
    if not isinstance(raw, dict):
        raise _invalid("text", "'text' must be an object.")
    for key in raw:
        if key not in ("format", "verbosity"):
            raise unsupported(f"text.{key}", f"'text.{key}' is not supported.")
    verbosity = raw.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise _invalid(
            "text.verbosity", "'text.verbosity' must be 'low', 'medium' or 'high'.", "invalid_value"
        )
    if verbosity not in (None, "medium"):
        left_out.add(
            "text.verbosity",
            "text.verbosity",
            "no chat template areal serves has a verbosity setting; the model is told nothing",
        )
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    fmt = raw.get("format")
    if fmt is None:
        return None, echo
    if not isinstance(fmt, dict):
        raise _invalid("text.format", "'text.format' must be an object.")
    kind = fmt.get("type")
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return {"type": "json_object"}, {**echo, "format": {"type": "json_object"}}
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
            **echo,
            "format": {"type": "json_schema", **spec},
        }
    raise _invalid(
        "text.format.type",
        "'text.format.type' must be 'text', 'json_object' or 'json_schema'.",
        "invalid_value",
    )


def _reasoning(raw: Any) -> tuple[str | None, str | None]:
    """(effort, summary) of `reasoning`."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict):
        raise _invalid("reasoning", "'reasoning' must be an object.")
    for key, value in raw.items():
        if key not in ("effort", "summary", "generate_summary") and value is not None:
            raise unsupported(f"reasoning.{key}", f"'reasoning.{key}' is not supported.")
    effort = raw.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _invalid(
            "reasoning.effort",
            f"'reasoning.effort' must be one of {', '.join(sorted(REASONING_EFFORTS))}.",
            "invalid_value",
        )
    summary = raw.get("summary")
    key = "summary"
    if summary is None:  # the older name of the same setting
        summary, key = raw.get("generate_summary"), "generate_summary"
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise _invalid(
            f"reasoning.{key}",
            f"'reasoning.{key}' must be one of {', '.join(sorted(REASONING_SUMMARIES))}.",
            "invalid_value",
        )
    return effort, summary


def _include(raw: Any, left_out: LeftOut) -> tuple[bool, bool]:
    """(logprobs, encrypted reasoning) asked for by `include`."""
    if raw is None:
        return False, False
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise _invalid("include", "'include' must be an array of strings.")
    logprobs = encrypted = False
    for j, value in enumerate(raw):
        if value == LOGPROBS_INCLUDE:
            logprobs = True
        elif value == ENCRYPTED_REASONING_INCLUDE:
            encrypted = True
        elif value in HOSTED_INCLUDES:
            left_out.add(
                f"include[{j}]",
                "include.hosted_output",
                f"{value!r}: areal runs no hosted tools and takes no image input",
            )
        else:
            raise unsupported(f"include[{j}]", f"'include' value {value!r} is not supported.")
    return logprobs, encrypted


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
    _reasoning(doc.get("reasoning"))
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
    left_out = LeftOut()
    # The tools first: the input's calls are named by them.
    tools = parse_tools(doc["tools"], left_out) if doc.get("tools") is not None else Tools()
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
        items = normalize_input(raw_input, tools)
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
        echo["tools"] = tools.echo
        if tools.chat:
            chat["tools"] = tools.chat
    choice = doc.get("tool_choice")
    if choice is not None:
        echo["tool_choice"] = choice
        # `auto` / `none` with every tool left out: no tools, nothing to choose.
        if tools.chat or choice not in ("auto", "none"):
            chat["tool_choice"] = parse_tool_choice(choice, tools)
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
        chat["parallel_tool_calls"] = parallel
        echo["parallel_tool_calls"] = parallel
    if doc.get("text") is not None:
        fmt, echo["text"] = _text(doc["text"], left_out)
        if fmt is not None:
            chat["response_format"] = fmt
    effort, summary = _reasoning(doc.get("reasoning"))
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    echo["reasoning"] = {"effort": effort, "summary": summary}
    logprobs, encrypted = _include(doc.get("include"), left_out)
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
    tier = doc.get("service_tier")
    if tier is not None:
        if tier not in ("auto", "default"):
            left_out.add(
                "service_tier", "service_tier", f"{tier!r}: areal serves every request alike"
            )
        echo["service_tier"] = "default"
    metadata = doc.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise _invalid("metadata", "'metadata' must be an object.")
    client_metadata = doc.get("client_metadata")
    if client_metadata is not None and not isinstance(client_metadata, dict):
        raise _invalid("client_metadata", "'client_metadata' must be an object.")
    return Translated(
        chat=chat,
        history=conversation,
        inputs=items,
        echo=echo,
        metadata=metadata,
        previous_response_id=previous,
        store=store,
        logprobs=logprobs,
        tools=tools,
        summary=summary is not None,
        encrypted_content=encrypted,
        left_out=left_out,
    )


def previous_id(doc: dict[str, Any]) -> str | None:
    previous = doc.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _invalid("previous_response_id", "'previous_response_id' must be a string.")
    return previous
