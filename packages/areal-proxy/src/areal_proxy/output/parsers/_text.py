"""Small text helpers shared by the parsers (not public API)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def hold_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker.

    That suffix could still grow into the marker, so a streamer must hold it back.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any marker (the longest one on a tie)."""
    found: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker)
        if i < 0:
            continue
        if found is None or i < found[0] or (i == found[0] and len(marker) > len(found[1])):
            found = (i, marker)
    return found


def split_trailing_ws(text: str) -> tuple[str, str]:
    body = text.rstrip()
    return body, text[len(body) :]


class WsHolder:
    """Streams text but holds back a trailing whitespace run.

    The caller decides what happens to the held run once the next thing is
    known: ``flush`` releases it (more text followed), ``drop`` discards it
    (a tool call or the end of a reasoning block followed). With
    ``strip_leading`` the whitespace before the first non-blank character is
    discarded as well.
    """

    __slots__ = ("pending", "seen_text", "strip_leading")

    def __init__(self, strip_leading: bool = False) -> None:
        self.pending = ""
        self.seen_text = False
        self.strip_leading = strip_leading

    def push(self, text: str) -> str:
        """Take ``text``; return what can be released now."""
        if not text:
            return ""
        body, ws = split_trailing_ws(text)
        if not body:
            self.pending += ws
            return ""
        if not self.seen_text:
            self.seen_text = True
            if self.strip_leading:
                self.pending = ""
                body = body.lstrip()
        out = self.pending + body
        self.pending = ws
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        if not self.seen_text and self.strip_leading:
            return ""
        return out

    def drop(self) -> None:
        self.pending = ""


class JsonEnd:
    """Finds, resumably, where the JSON object or array that opens a text ends.

    Tracks bracket depth outside strings only; it does not validate. Feed it
    the same (growing) text each time; it continues where it stopped.
    """

    __slots__ = ("depth", "end", "escape", "in_string", "pos")

    def __init__(self) -> None:
        self.end: int | None = None
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False

    def scan(self, text: str) -> int | None:
        """Index just after the closing bracket, or None if not closed yet."""
        if self.end is not None:
            return self.end
        i = self.pos
        n = len(text)
        depth, in_string, escape = self.depth, self.in_string, self.escape
        while i < n:
            c = text[i]
            i += 1
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth <= 0:
                    self.end = i
                    return i
        self.pos, self.depth, self.in_string, self.escape = i, depth, in_string, escape
        return None


class _Invalid(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _Invalid(name)


_MISSING = object()


def loads_strict(text: str) -> Any:
    """json.loads that rejects NaN/Infinity; returns _MISSING on any failure."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, _Invalid, RecursionError):
        return _MISSING


def is_missing(value: Any) -> bool:
    return value is _MISSING


def dump_args(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def normalize_arguments(args: Any) -> str | None:
    """Arguments value from a model -> JSON text of an object, or None if unusable.

    Accepts an object, null/absent (no arguments) or a string holding a JSON
    object (some models double-encode).
    """
    if args is None:
        return "{}"
    if isinstance(args, str):
        if not args.strip():
            return "{}"
        args = loads_strict(args)
    if isinstance(args, dict):
        return dump_args(args)
    return None


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> (name, arguments JSON)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    if "arguments" in obj:
        raw = obj["arguments"]
    else:
        raw = obj.get("parameters")
    arguments = normalize_arguments(raw)
    if arguments is None:
        return None
    return name, arguments


def calls_from_json(text: str, allow_list: bool = True) -> list[tuple[str, str]] | None:
    """A JSON object (or list of objects) of calls -> calls, or None if any is invalid."""
    value = loads_strict(text)
    if value is _MISSING:
        return None
    items = value if (allow_list and isinstance(value, list)) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        call = call_from_object(item)
        if call is None:
            return None
        calls.append(call)
    return calls
