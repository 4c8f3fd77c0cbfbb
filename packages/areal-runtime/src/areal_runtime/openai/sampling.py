"""Sampling settings common to chat and completions, and the output constraint
(`response_format`, SGLang's `regex` / `ebnf`), engine-neutral."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from areal_runtime.openai.fields import (
    MAX_N,
    MAX_STOP,
    bad,
    is_num,
    read_bool,
    read_int,
    read_int_list,
    read_num,
    unsupported,
)


@dataclass(frozen=True, slots=True)
class Constraint:
    """Constrained decoding, engine-neutral: `kind` is json_schema, regex, ebnf or
    structural_tag (SGLang's sampling parameter names), `value` the engine's string."""

    kind: str
    value: str


@dataclass(slots=True)
class Sampling:
    """Sampling settings common to chat and completions."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    n: int = 1
    constraint: Constraint | None = None
    # Engine sampling fields with no typed slot, forwarded as they came.
    extra: dict[str, Any] = field(default_factory=dict)


def read_sampling(d: dict[str, Any]) -> Sampling:
    s = Sampling()
    n = read_int(d, "n")
    if n is not None:
        if not 1 <= n <= MAX_N:
            raise bad(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
        s.n = n
    best_of = read_int(d, "best_of")
    if best_of is not None and best_of != s.n:
        raise unsupported("best_of", "other than n is not supported (areal returns every sample)")
    for key in ("max_completion_tokens", "max_tokens"):
        v = read_int(d, key)
        if v is not None:
            if v < 1:
                raise bad(f"'{key}' must be at least 1, got {v}", key)
            if s.max_tokens is None:
                s.max_tokens = v
    s.temperature = read_num(d, "temperature", 1.0, 0.0, 2.0)
    s.top_p = read_num(d, "top_p", 1.0, 0.0, 1.0)
    if s.top_p == 0.0:  # "top_p": 0 means greedy to most clients; engines refuse 0
        s.top_p, s.top_k = 1.0, 1
    s.frequency_penalty = read_num(d, "frequency_penalty", 0.0, -2.0, 2.0)
    s.presence_penalty = read_num(d, "presence_penalty", 0.0, -2.0, 2.0)
    s.min_p = read_num(d, "min_p", 0.0, 0.0, 1.0)
    s.repetition_penalty = read_num(d, "repetition_penalty", 1.0, 1e-6, 1e6)
    top_k = read_int(d, "top_k")
    if top_k is not None and s.top_k == -1:
        if top_k < -1:
            raise bad("'top_k' must be -1 (off) or a positive integer", "top_k")
        s.top_k = top_k if top_k > 0 else -1
    s.seed = read_int(d, "seed")
    s.ignore_eos = read_bool(d, "ignore_eos")
    s.skip_special_tokens = read_bool(d, "skip_special_tokens", True)
    stop = d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
        s.stop = [x for x in stop if x]
        if s.stop:
            s.extra["stop"] = s.stop
    if (ids := d.get("stop_token_ids")) is not None:
        s.stop_token_ids = read_int_list(ids, "stop_token_ids")
    if (bias := d.get("logit_bias")) is not None:
        if not isinstance(bias, dict) or not all(is_num(v) for v in bias.values()):
            raise bad("'logit_bias' must map token ids to numbers", "logit_bias")
        if bias:
            s.extra["logit_bias"] = {str(k): float(v) for k, v in bias.items()}
    s.constraint = _constraint(d)
    return s


def _constraint(d: dict[str, Any]) -> Constraint | None:
    """The output constraint of `response_format`, or of SGLang's `regex` / `ebnf`."""
    found: list[Constraint] = []
    for key in ("regex", "ebnf"):
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise bad(f"'{key}' must be a non-empty string", key)
        found.append(Constraint(key, v))
    rf = d.get("response_format")
    if rf is not None:
        c = response_format_constraint(rf, "response_format")
        if c is not None:
            found.append(c)
    if len(found) > 1:
        raise bad(
            "only one of 'response_format', 'regex' and 'ebnf' may constrain the output",
            "response_format",
        )
    return found[0] if found else None


def response_format_constraint(rf: Any, param: str) -> Constraint | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad(f"'{param}' must be an object with a string 'type'", param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad(f"'{param}.json_schema' must be an object", f"{param}.json_schema")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("'schema' must be a JSON schema object", f"{param}.json_schema.schema")
        if (strict := js.get("strict")) is not None and not isinstance(strict, bool):
            raise bad("'strict' must be a boolean", f"{param}.json_schema.strict")
        # strict or not, the output is held to the schema: the engine enforces it.
        return Constraint("json_schema", orjson.dumps(schema or {"type": "object"}).decode())
    if kind == "regex":  # SGLang's extension of response_format
        pattern = rf.get("regex") or rf.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise bad("a 'regex' response format needs a string 'regex'", f"{param}.regex")
        return Constraint("regex", pattern)
    raise bad(
        f"response format type {kind!r} is not supported "
        "(expected text, json_object, json_schema or regex)",
        f"{param}.type",
        "unsupported_parameter",
    )
