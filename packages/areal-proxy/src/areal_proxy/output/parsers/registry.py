"""Name -> parser class registries for tool-call and reasoning parsers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_TOOL_PARSERS: dict[str, type[Any]] = {}
_REASONING_PARSERS: dict[str, type[Any]] = {}


def _register(table: dict[str, type[Any]], kind: str, name: str) -> Callable[[type], type]:
    if not name:
        raise ValueError(f"{kind} parser name must be non-empty")

    def deco(cls: type) -> type:
        existing = table.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} parser {name!r} is already registered ({existing.__name__})")
        table[name] = cls
        return cls

    return deco


def register_tool_parser(name: str) -> Callable[[type], type]:
    """Class decorator: make a ToolParser subclass available under ``name``."""
    return _register(_TOOL_PARSERS, "tool", name)


def register_reasoning_parser(name: str) -> Callable[[type], type]:
    """Class decorator: make a ReasoningParser subclass available under ``name``."""
    return _register(_REASONING_PARSERS, "reasoning", name)


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def reasoning_parser_names() -> list[str]:
    return sorted(_REASONING_PARSERS)


def get_tool_parser(name: str) -> type[Any]:
    check_parser_names(name, None)
    return _TOOL_PARSERS[name]


def get_reasoning_parser(name: str) -> type[Any]:
    check_parser_names(None, name)
    return _REASONING_PARSERS[name]


def check_parser_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Raise ValueError, listing the known names, for an unknown parser name.

    None or "" means "off" and is always accepted.
    """
    if tool_parser and tool_parser not in _TOOL_PARSERS:
        raise ValueError(
            f"unknown tool parser {tool_parser!r}; known: {', '.join(tool_parser_names())}"
        )
    if reasoning_parser and reasoning_parser not in _REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r}; "
            f"known: {', '.join(reasoning_parser_names())}"
        )
