"""`tool_choice: "required"` or a named function, enforced by constrained decoding.

The output is held to a call in the configured tool parser's own format (what the model's
chat template renders, so a recorded RL turn reads like one the model wrote unforced), the
arguments to the function's JSON schema. The constraint is an xgrammar structural tag
(SGLang's and vLLM's `structural_tag`):

    hermes / qwen25:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (one or more)
    llama3:           {"name": "f", "parameters": {...}}  (several joined by "; ")

`required` makes one call with `parallel_tool_calls: false`, else one to as many calls as
there are tools (a bound, so that a model that would rather call again than stop still ends).

With --forced-call-token-ids (off by default: SGLang 0.5.23 fails many such requests, see
docs/openai-api.md), the fixed text of a call (the scaffold: `<tool_call>\\n{"name": "f",
"arguments":` and `\\n</tool_call>`) is forced as the tokenizer's own ids (xgrammar `token`
elements), not as text. A text constraint lets the sampler spell it in any tokens that make
up the text, and a policy at temperature 1 picks odd ones (SmolLM2-135M: `<`,`t`,`oo`,`l`,...
55 tokens for a call the tokenizer writes in 34), so RL would train on sequences the model
never writes. Where the scaffold meets the model's own text (the space before the arguments,
the brace after them) the seam stays text, since the tokenizer merges it with the model's
tokens (SmolLM2 writes ` {"` and `"}}` as one token each): the seams are found by tokenizing
a whole sample call (`Scaffold`).

Parsers whose call syntax is made of special tokens (mistral's [TOOL_CALLS], deepseek's
markers) and outputs that begin with reasoning cannot be constrained this way: those requests
get a 400 naming `tool_choice` rather than an unenforced choice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from areal_proxy.engine.base import JSON_MAX_WHITESPACE
from areal_proxy.output.structured_json import engine_schema
from areal_runtime.openai import Constraint, bad

Encode = Callable[[str], list[int]]

# Stands in for a call's arguments when finding where the tokenizer puts token boundaries
# around them: an object that opens on a key and closes on a string value, as most do.
_SAMPLE_ARGS = '{"a": "b"}'


class Scaffold:
    """A model tokenizer's ids for the fixed text of forced calls, cached per text (a request
    offers the same few tools again and again; finding the seams costs one encode per
    character of the head)."""

    def __init__(self, encode: Encode) -> None:
        self._encode = encode
        self.split = lru_cache(maxsize=1024)(self._split)
        self.joins = lru_cache(maxsize=64)(self._joins)

    def _split(self, head: str, tail: str) -> tuple[tuple[int, ...], str, str, tuple[int, ...]]:
        """(ids of the longest start of `head`, the rest of `head`, the start of `tail`, ids
        of the longest end of `tail`) such that the ids are where the tokenizer puts them in a
        whole call: the rest and the start are seams, left as text."""
        enc = self._encode
        whole = enc(head + _SAMPLE_ARGS + tail)
        head_ids: list[int] = []
        for cut in range(len(head), 0, -1):
            ids = enc(head[:cut])
            if whole[: len(ids)] == ids:
                head_ids, head = ids, head[cut:]
                break
        tail_ids: list[int] = []
        for cut in range(len(tail)):
            ids = enc(tail[cut:])
            if ids and whole[-len(ids) :] == ids:
                tail_ids, tail = ids, tail[:cut]
                break
        return tuple(head_ids), head, tail, tuple(tail_ids)

    def _joins(self, call: str, sep: str) -> tuple[int, ...] | None:
        """The ids of `sep` between two calls, None where the tokenizer merges it with them
        (then it stays text)."""
        enc = self._encode
        ids = enc(sep)
        return tuple(ids) if enc(call + sep + call) == enc(call) + ids + enc(call) else None


def _tokens(ids: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"type": "token", "token": i} for i in ids]


def _text(s: str) -> list[dict[str, Any]]:
    return [{"type": "const_string", "value": s}] if s else []


def _call_tag(
    prefix: str,
    name: str,
    args_key: str,
    schema: dict[str, Any],
    end: str,
    scaffold: Scaffold | None,
) -> dict[str, Any]:
    head = f'{prefix}{{"name": {json.dumps(name)}, "{args_key}": '
    tail = f"}}{end}"
    args = {
        "type": "json_schema",
        "json_schema": engine_schema(schema or {"type": "object"}, "tools"),
        "max_whitespace_cnt": JSON_MAX_WHITESPACE,
    }
    if scaffold is None:
        return {"type": "tag", "begin": head, "content": args, "end": tail}
    head_ids, head_seam, tail_seam, tail_ids = scaffold.split(head, tail)
    return {
        "type": "sequence",
        "elements": [
            *_tokens(head_ids),
            *_text(head_seam),
            args,
            *_text(tail_seam),
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
    scaffold: Scaffold | None,
) -> Constraint | None:
    """The constraint that enforces `tool_choice`, None when it asks for nothing to enforce.
    `scaffold`: the model tokenizer's ids for the fixed text; None holds it as text only."""
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
    tags = [
        _call_tag(prefix, f["name"], args_key, f.get("parameters") or {}, end, scaffold)
        for f in chosen
    ]
    sep_ids = None
    if scaffold is not None and most > 1:
        sep_ids = scaffold.joins(f'{prefix}{{"name": "f", "{args_key}": {_SAMPLE_ARGS}}}{end}', sep)
    return Constraint(
        "structural_tag",
        json.dumps({"type": "structural_tag", "format": _calls(tags, sep, sep_ids, most)}),
    )


def _calls(
    tags: list[dict[str, Any]], sep: str, sep_ids: tuple[int, ...] | None, most: int
) -> dict[str, Any]:
    """One to `most` calls, each any of `tags`, `sep` between two (as `sep_ids` if given)."""
    call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if most <= 1:
        return call
    between = _tokens(sep_ids) if sep_ids is not None else _text(sep)
    more = {"type": "sequence", "elements": [*between, call]}
    return {
        "type": "sequence",
        "elements": [call, {"type": "repeat", "min": 0, "max": most - 1, "content": more}],
    }


def _show(choice: Any) -> str:
    if isinstance(choice, dict):
        return f"(function {choice['function']['name']!r})"
    return repr(choice)
