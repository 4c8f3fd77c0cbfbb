"""How a service is supervised: `[supervision]` in the config and `--[no-]supervise`,
stored in the state (`.supervision`) where the detached watchdog reads it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from areal_cli.errors import CLIError


@dataclass
class Policy:
    """How a service is supervised (`[supervision]` in the config, `--[no-]supervise`)."""

    enabled: bool = True
    max_restarts: int = 5
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    check_interval: float = 1.0
    hung_after: int = 3
    window: float = 600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Policy:
        d = d or {}
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def check(self) -> Policy:
        if self.max_restarts < 0:
            raise CLIError("[supervision] max_restarts must be 0 or more", code=2)
        for name in ("backoff_initial", "backoff_max", "check_interval", "window"):
            if getattr(self, name) <= 0:
                raise CLIError(f"[supervision] {name} must be positive", code=2)
        if self.backoff_max < self.backoff_initial:
            raise CLIError("[supervision] backoff_max must be >= backoff_initial", code=2)
        if self.hung_after < 1:
            raise CLIError("[supervision] hung_after must be at least 1", code=2)
        return self


def policy_from_config(cfg: Any, supervise_flag: bool | None) -> Policy:
    """`--supervise/--no-supervise` > `[supervision]` keys > built-in defaults."""
    p = Policy()
    for key in Policy.__dataclass_fields__:
        value = cfg.get("supervision", key)
        if value is not None:
            setattr(p, key, type(getattr(p, key))(value))
    if supervise_flag is not None:
        p.enabled = supervise_flag
    return p.check()
