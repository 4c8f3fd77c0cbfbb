"""Flags and environment for a service's settings dataclass (each default exists once).

    @dataclass
    class Settings:
        port: int = field(default=0, metadata={"help": "0 = the OS picks"})

    settings = parse_settings(Settings, argv, prog="areal-router", env_prefix="AREAL_ROUTER_",
                              version="0.1.0")

Precedence: flag > `<env_prefix><FIELD>` > the dataclass default. Fields whose
metadata has `"secret": True` are read from the environment only (argv is
visible to every local user and is recorded in service state).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off", ""}


def _convert(kind: Any, raw: str, name: str) -> Any:
    if kind is bool:
        low = raw.strip().lower()
        if low in _BOOL_TRUE:
            return True
        if low in _BOOL_FALSE:
            return False
        raise ValueError(f"{name}: expected true/false, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}") from None
    return raw


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    kind = hints.get(f.name, str)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if (
        typing.get_origin(kind) in (typing.Union, getattr(__import__("types"), "UnionType", None))
        and args
    ):
        kind = args[0]
    return kind


def parse_settings(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    env_prefix: str,
    version: str,
    description: str | None = None,
) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {version}")
    env_values: dict[str, Any] = {}
    secrets: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _field_type(cls, f)
        env_name = env_prefix + f.name.upper()
        meta = f.metadata
        if env_name in os.environ:
            env_values[f.name] = _convert(kind, os.environ[env_name], env_name)
        if meta.get("secret"):
            secrets.append(f.name)
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = meta.get("help", "")
        help_text = f"{help_text} (default: {default!r}; env {env_name})".strip()
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif kind in (int, float, str):
            parser.add_argument(flag, type=kind, metavar=meta.get("metavar"), **kw)
        else:
            parser.add_argument(flag, **kw)
    try:
        ns = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit:
        raise
    values = dict(env_values)
    values.update({k: v for k, v in vars(ns).items() if v is not None})
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        choices = f.metadata.get("choices")
        if choices and f.name in values and values[f.name] not in choices:
            parser.error(f"{f.name}: {values[f.name]!r} is not one of {', '.join(choices)}")
    return cls(**values)
