"""The override grammar, read by hydra's own parser (hydra-core's `OverridesParser`).

`parse(arg)` says whether a driver argument is an override (`a.b=1`, `+a.b=1`, `++a.b=1`,
`~a.b`, `~a.b=1`) and splits it; `value(text, keep_text)` turns the text after `=` into a
value the way hydra does (`null`, booleans, numbers, quotes, `[..]` lists, `{..}` maps,
`${..}` kept for OmegaConf to resolve). What applies an override to the config, with its
error messages, is config.py's.

Where hydra's grammar is narrower than what a driver's argv held before it was used, the
old reading is kept, so no command line changes meaning:

- a value hydra does not parse (an unquoted `=` or `?`, as in a URL) is its raw text, unless
  it starts a list or a map (`[`, `{`): then it is an error naming the value;
- a value hydra reads as a sweep (`1,2`, `range(..)`: multirun, which a driver run is not)
  is its raw text too;
- a key with a config group (`a/b=`) or a package (`a@p=`) is not an override (hydra's
  defaults list is not used here): it goes to the driver's extras.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException

_PREFIX = {
    OverrideType.CHANGE: "",
    OverrideType.ADD: "+",
    OverrideType.FORCE_ADD: "++",
    OverrideType.DEL: "~",
}


class BadValue(ValueError):
    """A value that starts a list or a map and does not parse; str() names it."""


@dataclass(frozen=True)
class Parsed:
    prefix: str  # "", "+", "++" or "~"
    key: str  # dotted
    raw: str | None  # the text after the first "=", None when there is no "="


@cache
def _parser() -> OverridesParser:
    # Building the ANTLR parser costs a few ms: once per process.
    return OverridesParser.create()


def _override(text: str) -> Override | None:
    try:
        return _parser().parse_override(text)
    except HydraException:
        return None


def parse(arg: str) -> Parsed | None:
    """The override `arg` is, or None when it is not one (a flag, a bare word, a group)."""
    head, eq, raw = arg.partition("=")
    # The key is read on its own (`key=`), so that a value hydra would refuse does not make
    # the whole argument "not an override".
    ov = _override(f"{head}=") if eq else _override(arg)
    if ov is None or not ov.key_or_group or ov.package is not None or "/" in ov.key_or_group:
        return None
    if not eq and ov.type is not OverrideType.DEL:
        return None
    return Parsed(_PREFIX[ov.type], ov.key_or_group, raw if eq else None)


def value(text: str, keep_text: bool) -> Any:
    """The value of an override's text. `keep_text` (a `str` field): the raw text, except
    `null` and a quoted string, which hydra reads."""
    stripped = text.strip()
    quoted = len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\""
    if keep_text and not quoted and stripped.lower() != "null":
        return text
    if not stripped:
        return text
    ov = _override(f"x={stripped}")
    if ov is None:
        if stripped[:1] in "[{":
            try:
                _parser().parse_override(f"x={stripped}")
            except HydraException as e:
                problem = str(e).splitlines()[0] if str(e) else "invalid"
                raise BadValue(f"cannot parse value {stripped!r}: {problem}") from None
        return text
    if ov.is_sweep_override():
        return text
    return ov.value()
