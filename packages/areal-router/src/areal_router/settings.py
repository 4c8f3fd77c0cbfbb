"""Every flag of `areal-router`, with its default, in one place (docs/services.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from areal_router import __version__
from areal_router.policies import POLICY_NAMES
from areal_runtime.settings import parse_settings

POLICIES = POLICY_NAMES
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "AREAL_ROUTER_"


@dataclass
class RouterSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0 = the OS picks"})
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS, "help": "log level"})
    ready_file: str = field(
        default="", metadata={"help": "write {pid, host, port, ...} here once listening"}
    )
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port; 0 = the OS picks, -1 = off"}
    )
    drain_timeout: float = field(
        default=10.0, metadata={"help": "seconds to finish in-flight calls on SIGTERM"}
    )
    policy: str = field(
        default="round_robin", metadata={"choices": POLICIES, "help": "routing policy"}
    )
    health_interval: float = field(
        default=1.0, metadata={"help": "seconds between GetStats polls of each proxy"}
    )
    health_idle_interval: float = field(
        default=30.0,
        metadata={
            "help": "seconds between GetStats polls of a proxy that is healthy, idle and "
            "unchanged, with its health stream open (a route, lease or bind naming it brings "
            "its next poll within --health-interval); at most --health-interval turns this off"
        },
    )
    health_timeout: float = field(default=1.0, metadata={"help": "seconds a poll may take"})
    unhealthy_after: int = field(
        default=2, metadata={"help": "consecutive failed polls before a proxy is unhealthy"}
    )
    route_lease: float = field(
        default=1.0,
        metadata={
            "help": "seconds a caller asking for a route lease may route requests without a "
            "session on its own, over the healthy proxies of the model, or send a pinned "
            "session's requests to its proxy (capped at --health-interval); 0 = every "
            "request is routed here"
        },
    )
    state_file: str = field(
        default="",
        metadata={
            "help": "SQLite file where registrations and session pins persist (empty: memory "
            "only; a JSON state of an older router is migrated)"
        },
    )
    pin_ttl: float = field(
        default=86400.0,
        metadata={
            "help": "seconds a session pin lives after its last use (a bind, or a route "
            "naming the session); 0 = until released"
        },
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.health_interval <= 0:
            raise ValueError("health_interval must be > 0")
        if self.health_idle_interval < 0:
            raise ValueError("health_idle_interval must be >= 0")
        if self.health_timeout <= 0:
            raise ValueError("health_timeout must be > 0")
        if self.unhealthy_after < 1:
            raise ValueError("unhealthy_after must be >= 1")
        if self.route_lease < 0:
            raise ValueError("route_lease must be >= 0")
        if self.pin_ttl < 0:
            raise ValueError("pin_ttl must be >= 0")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")


def parse(argv: Sequence[str] | None = None) -> RouterSettings:
    return parse_settings(
        RouterSettings,
        argv,
        prog="areal-router",
        env_prefix=ENV_PREFIX,
        version=__version__,
        description="areal router: registry of data proxies and models, routing, health.",
    )
