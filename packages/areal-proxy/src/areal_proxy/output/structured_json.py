"""JSON-schema outputs: the schema the engine's grammar gets, and the check of what it made.

xgrammar (the grammar backend of SGLang 0.5.23 and vLLM 0.32) compiles a string with
`minLength` / `maxLength` to "n characters other than `"`, `\\`, CR and LF": the other control
characters U+0000-U+001F pass raw, which RFC 8259 forbids in a string (`json.loads` and
pydantic refuse the output; measured on the CPU engine, tiny-random at t=1: 6 of 15 outputs).
Its regular expressions on strings do exclude them, so the engine gets such a string as the
equivalent `pattern` (`^[^controls"\\ surrogates]{min,max}$`: the same characters the length
rule allows, less the control characters, counted as the JSON-decoded string counts them, as
it has no escapes). A string with both a `pattern` and a length is refused (400): xgrammar
keeps the pattern and drops the length, and no regular expression can say both in general.

Past 128 characters a length is written as several repetitions of at most 128 (xgrammar
cannot compile one longer), up to 2,048: the grammar holds every length bound it is given.

Whatever the grammar lets through, a finished output is checked against the request's own
schema (`check`); one that is not JSON or breaks the schema is not returned as an answer.
"""

from __future__ import annotations

import json
from typing import Any

from areal_runtime.openai import bad

# Characters a length-bounded string may hold: xgrammar's length rule less the control
# characters; UTF-16 surrogates (which UTF-8 cannot hold, but xgrammar's character classes
# accept as 3-byte sequences that then decode to 3 replacement characters) are out too.
# The largest repetition bound the engines' grammar backend compiles in a pattern.
_MAX_PATTERN_BOUND = 128
# The longest bound written as a pattern (16 repetitions of 128; longer ones are rare in
# structured outputs, and the grammar's compile time grows with each).
_MAX_PATTERN_LENGTH = 2048
_STRING_CHAR = r'[^\u0000-\u001f"\\\ud800-\udfff]'
# Keywords that decide a string's text whatever its length says.
_FIXED = ("enum", "const", "format")
# Where a schema holds subschemas: one subschema / a list of them / a name -> subschema map.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def engine_schema(schema: Any, param: str) -> Any:
    """`schema` as the engine's grammar should get it (a copy; the request's stays as it is).
    `param` names the schema in a 400."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = engine_schema(out[key], param)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [engine_schema(s, param) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: engine_schema(s, param) for k, s in out[key].items()}
    if isinstance(out.get("items"), list):  # draft 4-7 tuple items
        out["items"] = [engine_schema(s, param) for s in out["items"]]
    if _is_string(out) and ("minLength" in out or "maxLength" in out):
        if "pattern" in out:
            raise bad(
                f"a string schema in '{param}' has both 'pattern' and 'minLength'/'maxLength', "
                "which the engine's grammar cannot enforce together: put the length in the "
                "pattern (e.g. '^[a-z]{1,8}$') and drop minLength/maxLength",
                param,
            )
        if not any(k in out for k in _FIXED):
            low = _bound(out.get("minLength", 0), "minLength", param)
            high = out.get("maxLength")
            top = None if high is None else _bound(high, "maxLength", param)
            pattern = _length_pattern(low, top)
            if pattern is not None:
                out.pop("minLength", None)
                out.pop("maxLength", None)
                out["pattern"] = pattern
    return out


def _length_pattern(low: int, top: int | None) -> str | None:
    """`^...$` for a string of `low` to `top` (None: any more) allowed characters, or None
    where the bounds are too long to write (the engine's own length rule then stays, and the
    final check catches a raw control character it lets through).

    xgrammar 0.2.7 fails to compile a repetition bound over 128 ("Check failed:
    per_rule_fsm_hashes"), so a longer length is written as repetitions of at most 128 in a
    row: `C{128}C{72}` is exactly 200 characters, `C{0,128}C{0,72}` 0 to 200 (measured with
    xgrammar 0.2.7: maxLength 200 and minLength 3 as `C{3}C{0,128}C{0,69}` take 3 to 200
    characters and refuse 2 and 201; it compiles in 0.05 s, 2,048 in 0.4 s)."""
    if low <= _MAX_PATTERN_BOUND and (top is None or top <= _MAX_PATTERN_BOUND):
        return f"^{_STRING_CHAR}{{{low},{'' if top is None else top}}}$"
    if max(low, top or 0) > _MAX_PATTERN_LENGTH:
        return None
    parts = []
    full, rest = divmod(low, _MAX_PATTERN_BOUND)
    parts += [f"{_STRING_CHAR}{{{_MAX_PATTERN_BOUND}}}"] * full
    if rest:
        parts.append(f"{_STRING_CHAR}{{{rest}}}")
    if top is None:
        parts.append(f"{_STRING_CHAR}*")
    else:
        full, rest = divmod(top - low, _MAX_PATTERN_BOUND)
        parts += [f"{_STRING_CHAR}{{0,{_MAX_PATTERN_BOUND}}}"] * full
        if rest:
            parts.append(f"{_STRING_CHAR}{{0,{rest}}}")
    return "^" + "".join(parts) + "$"


def _is_string(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and kind == ["string"])


def _bound(value: Any, key: str, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(f"'{key}' in '{param}' must be a non-negative integer", param)
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check(schema: dict[str, Any], text: str) -> str | None:
    """Why `text` is not a JSON document valid for `schema` (None: it is)."""
    import jsonschema  # only requests with a JSON schema pay for importing it

    try:
        value = json.loads(text, parse_constant=_no_constant)  # strict: no raw controls
    except ValueError as e:
        return f"the output is not JSON ({e})"
    cls = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the document)"
        return f"the output breaks the schema at {where}: {_rule(error)}"
    return None


def _rule(error: Any) -> str:
    """The rule an output broke, in the schema's words: never the output itself (a model's
    text at temperature 1 may be long, odd, or hold control characters)."""
    rule, value = error.validator, error.validator_value
    if rule == "maxLength":
        return f"a string too long (maxLength {value})"
    if rule == "minLength":
        return f"a string too short (minLength {value})"
    if rule in ("required", "additionalProperties", "type", "enum", "const"):
        return str(error.message)[:200]
    return f"'{rule}' ({json.dumps(value)[:120]}) not met"
