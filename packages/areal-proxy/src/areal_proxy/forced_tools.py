"""`tool_choice: "required"` or a named function, enforced by constrained decoding.

The output is held to a call in the configured tool parser's own format (what the model's
chat template renders, so a recorded RL turn reads like one the model wrote unforced), the
arguments to the function's JSON schema. The constraint is an xgrammar structural tag
(SGLang's and vLLM's `structural_tag`):

    hermes / qwen25:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (one or more)
    llama3:           {"name": "f", "parameters": {...}}  (several joined by "; ")

The fixed text around the arguments (the scaffold) is forced as token ids, the tokenizer's
own encoding of it, not as text: a text constraint lets the sampler spell `<tool_call>` in
any tokens that make up the text, and a policy sampled at temperature 1 picks the odd ones
(measured on SmolLM2-135M: a 34-token call recorded as 55 tokens), so RL would train on
sequences the model never writes. Where the scaffold meets the model's own text (the space
before the arguments, the brace after them) the seam stays text: the tokenizer may merge it
with what the model writes (SmolLM2 writes ` {"` and `}}` as single tokens).

Parsers whose call syntax is made of special tokens (mistral's [TOOL_CALLS], deepseek's
markers) and outputs that begin with reasoning cannot be constrained this way: those requests
get a 400 naming `tool_choice` rather than an unenforced choice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from areal_proxy.engine.base import JSON_MAX_WHITESPACE
from areal_proxy.structured_json import engine_schema
from areal_runtime.openai import Constraint, bad

Encode = Callable[[str], list[int]]

# Stands in for the arguments when finding where the tokenizer puts token boundaries around
# them: a typical object, opening with a key and closing on a value.
_SAMPLE_ARGS = '{"a": 1}'


def _tokens(ids: list[int]) -> list[dict[str, Any]]:
    return [{"type": "token", "token": i} for i in ids]


def _text(s: str) -> list[dict[str, Any]]:
    return [{"type": "const_string", "value": s}] if s else []


def split_head(encode: Encode, head: str, full: str) -> tuple[list[int], str]:
    """The longest start of `head` whose encoding starts the encoding of `full` (a whole
    call): (its ids, the rest of `head`, left as text for the seam)."""
    whole = encode(full)
    for cut in range(len(head), 0, -1):
        ids = encode(head[:cut])
        if whole[: len(ids)] == ids:
            return ids, head[cut:]
    return [], head


def split_tail(encode: Encode, tail: str, full: str) -> tuple[str, list[int]]:
    """The longest end of `tail` whose encoding ends the encoding of `full`: (the rest of
    `tail` before it, left as text for the seam, its ids)."""
    whole = encode(full)
    for cut in range(len(tail)):
        ids = encode(tail[cut:])
        if ids and whole[-len(ids) :] == ids:
            return tail[:cut], ids
    return tail, []


def _call(
    encode: Encode, prefix: str, name: str, args_key: str, schema: dict[str, Any], end: str
) -> dict[str, Any]:
    head = f'{prefix}{{"name": {json.dumps(name)}, "{args_key}": '
    tail = f"}}{end}"
    full = head + _SAMPLE_ARGS + tail
    head_ids, head_text = split_head(encode, head, full)
    tail_text, tail_ids = split_tail(encode, tail, full)
    args = {
        "type": "json_schema",
        "json_schema": engine_schema(schema or {"type": "object"}, "tools"),
        "max_whitespace_cnt": JSON_MAX_WHITESPACE,
    }
    return {
        "type": "sequence",
        "elements": [
            *_tokens(head_ids),
            *_text(head_text),
            args,
            *_text(tail_text),
            *_tokens(tail_ids),
        ],
    }


# parser -> (text before a call, the arguments key, text after a call, between two calls)
_FORMATS: dict[str, tuple[str, str, str, str]] = {
    "hermes": ("<tool_call>\n", "arguments", "\n</tool_call>", "\n"),
    "qwen25": ("<tool_call>\n", "arguments", "\n</tool_call>", "\n"),
    "llama3": ("", "parameters", "", "; "),
}


def forced_constraint(
    parser: str,
    reasoning_parser: str,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool,
    encode: Encode,
) -> Constraint | None:
    """The constraint that enforces `tool_choice`, None when it asks for nothing to enforce.
    `encode`: the model tokenizer's text -> ids, no special tokens added."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise bad(f"'tool_choice' {_show(tool_choice)} needs 'tools'", "tool_choice")
    fmt = _FORMATS.get(parser)
    if fmt is None:
        why = (
            "this model has no tool-call parser (start the proxy with --tool-call-parser)"
            if not parser
            else f"the {parser!r} tool-call parser's format cannot be enforced "
            f"(enforceable: {', '.join(sorted(_FORMATS))})"
        )
        raise bad(
            f"'tool_choice' {_show(tool_choice)} cannot be enforced: {why}",
            "tool_choice",
            "unsupported_parameter",
        )
    if reasoning_parser:
        raise bad(
            f"'tool_choice' {_show(tool_choice)} cannot be enforced with a reasoning parser "
            "(the reasoning that comes first is unconstrained)",
            "tool_choice",
            "unsupported_parameter",
        )
    prefix, args_key, end, sep = fmt
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in functions:
            raise bad(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        chosen = [functions[name]]
    else:
        chosen = list(functions.values())
    # A named function is "call exactly this function" (OpenAI's forced-function semantics),
    # so it is one call whatever `parallel_tool_calls` says; "required" may make several.
    single = isinstance(tool_choice, dict) or not parallel
    calls = [
        _call(encode, prefix, f["name"], args_key, f.get("parameters") or {}, end) for f in chosen
    ]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if single:
        fmt_tag = one
    else:
        more = {"type": "sequence", "elements": [*_text(sep), one]}
        fmt_tag = {"type": "sequence", "elements": [one, {"type": "star", "content": more}]}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt_tag}))


def _show(choice: Any) -> str:
    if isinstance(choice, dict):
        return f"(function {choice['function']['name']!r})"
    return repr(choice)
