"""`tool_choice: "required"` or a named function, enforced by constrained decoding.

The output is held to a call in the configured tool parser's own format (what the model's
chat template renders, so a recorded RL turn reads like one the model wrote unforced), the
arguments to the function's JSON schema. The constraint is an xgrammar structural tag
(SGLang's and vLLM's `structural_tag`):

    hermes / qwen25:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (one or more)
    llama3:           {"name": "f", "parameters": {...}}  (several joined by "; ")

`required` makes one call with `parallel_tool_calls: false`, else one to as many calls as
there are tools (a bound, so that a model that would rather call again than stop still ends).

Parsers whose call syntax is made of special tokens (mistral's [TOOL_CALLS], deepseek's
markers) and outputs that begin with reasoning cannot be constrained this way: those requests
get a 400 naming `tool_choice` rather than an unenforced choice.
"""

from __future__ import annotations

import json
from typing import Any

from areal_proxy.engine.base import JSON_MAX_WHITESPACE
from areal_proxy.structured_json import engine_schema
from areal_runtime.openai import Constraint, bad


def _call_tag(prefix: str, name: str, args_key: str, schema: dict[str, Any], end: str) -> dict:
    return {
        "type": "tag",
        "begin": f'{prefix}{{"name": {json.dumps(name)}, "{args_key}": ',
        "content": {
            "type": "json_schema",
            "json_schema": engine_schema(schema or {"type": "object"}, "tools"),
            "max_whitespace_cnt": JSON_MAX_WHITESPACE,
        },
        "end": f"}}{end}",
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
) -> Constraint | None:
    """The constraint that enforces `tool_choice`, None when it asks for nothing to enforce."""
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
    # so it is one call whatever `parallel_tool_calls` says; "required" may make several, but
    # at most one per tool offered. Unbounded, a model that prefers another call to its end of
    # turn never stops: SmolLM2-135M at temperature 0 wrote the same call 3 times, then hit
    # max_tokens. After each call the model may end its turn (EOS) or, below the bound, write
    # another.
    most = 1 if isinstance(tool_choice, dict) or not parallel else len(chosen)
    tags = [_call_tag(prefix, f["name"], args_key, f.get("parameters") or {}, end) for f in chosen]
    return Constraint(
        "structural_tag", json.dumps({"type": "structural_tag", "format": _calls(tags, sep, most)})
    )


def _calls(tags: list[dict[str, Any]], sep: str, most: int) -> dict[str, Any]:
    """One to `most` calls, each any of `tags`, `sep` between two."""
    call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if most <= 1:
        return call
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": sep}, call]}
    return {
        "type": "sequence",
        "elements": [call, {"type": "repeat", "min": 0, "max": most - 1, "content": more}],
    }


def _show(choice: Any) -> str:
    if isinstance(choice, dict):
        return f"(function {choice['function']['name']!r})"
    return repr(choice)
