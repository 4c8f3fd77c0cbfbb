"""TOML configuration of the `inf` and `agent` groups.

Precedence, per value: CLI flag > file passed with `--config` > the group's
default file `$AREAL_HOME/<group>/config.toml` > the built-in default.

Every table has a schema of allowed keys and types. A malformed file, an
unknown table or key, or a value of the wrong type is a CLIError that names
the file and the key: nothing is silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from areal_cli.errors import CLIError

# table path -> {key: allowed types}. Tables nest with dots ("register.internal").
Types = tuple[type, ...]
_STR: Types = (str,)
_INT: Types = (int,)
_NUM: Types = (int, float)
_BOOL: Types = (bool,)

_ENGINE: dict[str, Types] = {"python": _STR, "default_args": _STR}
_BINARIES_INF: dict[str, Types] = {"gateway": _STR, "router": _STR, "proxy": _STR}
_BINARIES_AGENT: dict[str, Types] = {**_BINARIES_INF, "agent_worker": _STR}
_STOP: dict[str, Types] = {"grace_period": _NUM}
# `--scheduler ray` (docs/cluster.md): the cluster, the resource a device maps to, a shared folder.
_SCHEDULER: dict[str, Types] = {
    "type": _STR,
    "address": _STR,
    "device_resource": _STR,
    "shared_dir": _STR,
    "gateway_nodes": (list,),  # node addresses, each a gateway (areal_cli.cluster.ray_gateways)
}
# areal_cli.watchdog.Policy; `--supervise/--no-supervise` overrides `enabled`.
_SUPERVISION: dict[str, Types] = {
    "enabled": _BOOL,
    "max_restarts": _INT,
    "backoff_initial": _NUM,
    "backoff_max": _NUM,
    "check_interval": _NUM,
    "hung_after": _INT,
    "window": _NUM,
}

SCHEMAS: dict[str, dict[str, dict[str, tuple[type, ...]]]] = {
    "inf": {
        "default": {"service": _STR, "admin_api_key": _STR, "log_level": _STR},
        "launch": {
            "gateway_host": _STR,
            "gateway_port": _INT,
            "gateways": _INT,
            "routing_strategy": _STR,
            "launch_timeout": _NUM,
            "log_level": _STR,
            "admin_api_key": _STR,
        },
        "scheduler": _SCHEDULER,
        "register": {},
        "register.internal": {
            "backend": _STR,
            "model_path": _STR,
            "tokenizer_path": _STR,
            "model_health_timeout": _NUM,
            "engine_args": _STR,
            "proxy_args": _STR,
            # Admission bounds (areal_cli.admission).
            "max_staleness": _INT,
            "batch_size": _INT,
            "max_concurrent_rollouts": _INT,
        },
        "engine": {},
        "engine.sglang": _ENGINE,
        "engine.vllm": _ENGINE,
        "binaries": _BINARIES_INF,
        "stop": _STOP,
        "supervision": _SUPERVISION,
    },
    "agent": {
        "default": {"service": _STR, "admin_api_key": _STR, "log_level": _STR},
        "run": {
            "agent": _STR,
            "num_pairs": _INT,
            "setup_timeout": _NUM,
            "health_poll_interval": _NUM,
            "drain_timeout": _NUM,
            "session_timeout": _NUM,
            "gateway_host": _STR,
            "gateway_port": _INT,
            "gateways": _INT,
            "routing_strategy": _STR,
            "inf_service": _STR,
            "inf_gateway_url": _STR,
            "inf_admin_api_key": _STR,
            "inf_model": _STR,
        },
        "scheduler": _SCHEDULER,
        "binaries": _BINARIES_AGENT,
        "stop": _STOP,
        "supervision": _SUPERVISION,
    },
}


def areal_home() -> Path:
    return Path(os.environ.get("AREAL_HOME") or Path.home() / ".areal")


def default_config_path(group: str) -> Path:
    return areal_home() / group / "config.toml"


class Config:
    """Merged TOML values of one group; `get(table, key)` returns None when unset."""

    def __init__(self, group: str, values: dict[str, dict[str, Any]], sources: list[Path]):
        self.group = group
        self.values = values
        self.sources = sources

    def get(self, table: str, key: str, default: Any = None) -> Any:
        return self.values.get(table, {}).get(key, default)

    def pick(self, flag: Any, table: str, key: str, builtin: Any = None) -> Any:
        """flag > config files > built-in."""
        if flag is not None:
            return flag
        value = self.get(table, key)
        return builtin if value is None else value


def _flatten(
    path: Path, schema: dict[str, dict[str, tuple[type, ...]]], data: dict[str, Any], prefix: str
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, value in data.items():
        table = f"{prefix}.{name}" if prefix else name
        if not isinstance(value, dict):
            where = f"[{prefix}] key '{name}'" if prefix else f"key '{name}'"
            if prefix and prefix in schema:
                raise CLIError(f"{path}: unknown {where} (allowed: {_allowed(schema, prefix)})")
            raise CLIError(f"{path}: {where} is not inside a known table")
        if table not in schema:
            known = ", ".join(f"[{t}]" for t in schema if schema[t])
            raise CLIError(f"{path}: unknown table [{table}] (known tables: {known})")
        keys = schema[table]
        scalars = {k: v for k, v in value.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in value.items() if isinstance(v, dict)}
        for key, v in scalars.items():
            if key not in keys:
                raise CLIError(
                    f"{path}: unknown key '{key}' in [{table}] (allowed: {_allowed(schema, table)})"
                )
            types = keys[key]
            if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
                want = " or ".join(t.__name__ for t in types)
                raise CLIError(
                    f"{path}: [{table}] key '{key}' must be {want}, got {type(v).__name__} {v!r}"
                )
        if scalars:
            out.setdefault(table, {}).update(scalars)
        for sub_table, sub in _flatten(path, schema, nested, table).items():
            out.setdefault(sub_table, {}).update(sub)
    return out


def _allowed(schema: dict[str, dict[str, tuple[type, ...]]], table: str) -> str:
    return ", ".join(schema[table]) or "only sub-tables"


def read_file(group: str, path: Path) -> dict[str, dict[str, Any]]:
    import tomllib

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CLIError(f"config file not found: {path}", code=2) from None
    except OSError as e:
        raise CLIError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CLIError(f"{path}: malformed TOML: {e}") from None
    return _flatten(path, SCHEMAS[group], data, "")


def load(group: str, explicit: str | Path | None = None) -> Config:
    """The group's default file (if present) overlaid by `explicit` (must exist)."""
    values: dict[str, dict[str, Any]] = {}
    sources: list[Path] = []
    default = default_config_path(group)
    files = [default] if default.is_file() else []
    if explicit is not None:
        files.append(Path(explicit).expanduser())
    for f in files:
        for table, kv in read_file(group, f).items():
            values.setdefault(table, {}).update(kv)
        sources.append(f)
    return Config(group, values, sources)
