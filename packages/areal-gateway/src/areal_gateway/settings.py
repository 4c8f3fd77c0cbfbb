"""Every setting of the gateway, each default once (docs/services.md, "Flags per binary").

Flags are generated from the dataclass by `areal_runtime.settings.parse_settings`;
each field can also come from `AREAL_GATEWAY_<FIELD>`. Secrets never come from argv: the
admin key is read from `AREAL_ADMIN_API_KEY`, the internal token from `AREAL_INTERNAL_TOKEN`,
the secret session keys are signed with from `AREAL_SESSION_KEY_SECRET`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from areal_gateway import __version__
from areal_runtime.auth import TOKEN_ENV
from areal_runtime.session_keys import MIN_SECRET_CHARS
from areal_runtime.session_keys import SECRET_ENV as SESSION_KEY_SECRET_ENV
from areal_runtime.settings import parse_settings

PROG = "areal-gateway"
ENV_PREFIX = "AREAL_GATEWAY_"
ADMIN_KEY_ENV = "AREAL_ADMIN_API_KEY"
# The key the docs show in examples; refused when the gateway listens beyond loopback.
DEFAULT_ADMIN_KEY = "areal-admin-key"
MODES = ("inference", "agent")


@dataclass
class Settings:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on; 0 = the OS picks"})
    reuse_port: bool = field(
        default=False,
        metadata={
            "help": "share --port with the other gateways of the service (SO_REUSEPORT: the "
            "kernel spreads new connections across them; only the same user can join)"
        },
    )
    own_port: int = field(
        default=-1,
        metadata={
            "help": "also listen on 127.0.0.1:<own-port>, this gateway's alone (its health "
            "probe when several share --port); 0 = any free port, -1 = no"
        },
    )
    log_level: str = field(
        default="info",
        metadata={"help": "log level", "choices": ["debug", "info", "warning", "error"]},
    )
    ready_file: str = field(
        default="", metadata={"help": "write {pid, host, port, ...} here once listening"}
    )
    router_addr: str = field(default="", metadata={"help": "host:port of the router (required)"})
    mode: str = field(
        default="inference", metadata={"help": "inference or agent", "choices": list(MODES)}
    )
    max_body_bytes: int = field(
        default=8 * 1024 * 1024, metadata={"help": "larger request bodies get 413"}
    )
    request_timeout: float = field(
        default=3600.0, metadata={"help": "seconds; the deadline put in each request envelope"}
    )
    drain_timeout: float = field(
        default=10.0, metadata={"help": "seconds to finish in-flight requests on SIGTERM"}
    )
    request_read_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds a connection has to send a whole request (head and body), from "
            "when it opens or its previous response ends; then it is closed (408 if a request "
            "had begun)"
        },
    )
    max_idle_connections_per_client: int = field(
        default=256,
        metadata={
            "help": "connections one client address may keep open between requests (past "
            "it a response says Connection: close: never is a connection closed that may carry "
            "a request), and connections that have sent nothing it may hold (past it those "
            "silent for 2 s are closed)"
        },
    )
    proxy_streams: bool = field(
        default=True,
        metadata={
            "help": "send generation requests to each proxy over one multiplexed Generate "
            "stream; --no-proxy-streams: one gRPC call per request"
        },
    )
    response_store: str = field(
        default="",
        metadata={
            "help": "keep stored Responses (previous_response_id, GET/DELETE "
            "/v1/responses/{id}) in this SQLite file, shared by every gateway of the service "
            "and kept across restarts (created 0600; its folder must exist); empty = in this "
            "process's memory"
        },
    )
    # Secrets: environment only (see load_settings).
    admin_api_key: str = field(default="", repr=False, metadata={"secret": True})
    internal_token: str = field(default="", repr=False, metadata={"secret": True})
    # Signs session keys; "" = random per process (keys die with it; see runtime.Gateway).
    session_key_secret: str = field(default="", repr=False, metadata={"secret": True})


class SettingsError(ValueError):
    """Settings the gateway refuses to start with (message is shown to the operator)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def validate(settings: Settings) -> None:
    if not settings.router_addr:
        raise SettingsError("--router-addr is required (host:port of the router)")
    if not settings.admin_api_key:
        raise SettingsError(f"the admin key is required: set {ADMIN_KEY_ENV} in the environment")
    if settings.admin_api_key == DEFAULT_ADMIN_KEY and not is_loopback(settings.host):
        raise SettingsError(
            f"refusing to listen on {settings.host} with the documented default admin key "
            f"{DEFAULT_ADMIN_KEY!r}: set {ADMIN_KEY_ENV} to a secret value, or bind to 127.0.0.1"
        )
    if settings.session_key_secret and len(settings.session_key_secret) < MIN_SECRET_CHARS:
        raise SettingsError(
            f"{SESSION_KEY_SECRET_ENV} is too short: give at least {MIN_SECRET_CHARS} random "
            "characters (or leave it unset: session keys are then valid for this process only)"
        )
    if settings.max_body_bytes < 1:
        raise SettingsError("--max-body-bytes must be at least 1")
    if settings.request_timeout <= 0:
        raise SettingsError("--request-timeout must be positive")
    if settings.drain_timeout < 0:
        raise SettingsError("--drain-timeout must not be negative")
    if settings.request_read_timeout <= 0:
        raise SettingsError("--request-read-timeout must be positive")
    if settings.own_port < -1 or settings.own_port > 65535:
        raise SettingsError("--own-port must be -1 (none), 0 (any free port) or a port")
    if settings.max_idle_connections_per_client < 1:
        raise SettingsError("--max-idle-connections-per-client must be at least 1")
    if settings.response_store:
        check_response_store(settings.response_store)


def check_response_store(path: str) -> None:
    """A --response-store the gateway can open (it creates the file, never its folder)."""
    import sqlite3

    from areal_gateway.openai.responses.sqlite_store import open_file

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SettingsError(
            f"--response-store {path}: the folder {folder} does not exist; create it first"
        )
    if os.path.isdir(path):
        raise SettingsError(f"--response-store {path} is a folder; give a file path in it")
    try:
        open_file(path).close()
    except (OSError, sqlite3.Error) as exc:
        raise SettingsError(
            f"--response-store {path}: cannot use it as a SQLite response store ({exc}); "
            "give a writable path to a new file or to a store an areal gateway made"
        ) from None


# --help names every variable the gateway reads (secrets are never flags: a flag shows in
# `ps`). argparse rewraps this text; each sentence stands on its own.
DESCRIPTION = (
    "areal gateway: OpenAI API and admin API over the router and data proxies. "
    f"Environment: {ADMIN_KEY_ENV} the admin API key (required; clients that use it may "
    f"call every endpoint). {TOKEN_ENV} the token the service's components present to each "
    f"other (the same in all of them). {SESSION_KEY_SECRET_ENV} signs session keys (at least "
    f"{MIN_SECRET_CHARS} characters; unset: a random one, and session keys die with the "
    "process). AREAL_TLS_CA, AREAL_TLS_CERT, AREAL_TLS_KEY: TLS between the components "
    "(all three or none). OTEL_* (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, ...): "
    f"OpenTelemetry tracing. {ENV_PREFIX}<FLAG> sets any flag below (shown with each)."
)


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Flags > AREAL_GATEWAY_* > defaults; secrets from the environment only."""
    settings = parse_settings(
        Settings,
        argv,
        prog=PROG,
        env_prefix=ENV_PREFIX,
        version=__version__,
        description=DESCRIPTION,
    )
    return dataclasses.replace(
        settings,
        admin_api_key=os.environ.get(ADMIN_KEY_ENV, "") or settings.admin_api_key,
        internal_token=os.environ.get(TOKEN_ENV, "") or settings.internal_token,
        session_key_secret=os.environ.get(SESSION_KEY_SECRET_ENV, "")
        or settings.session_key_secret,
    )
