"""What the watchdog asks a component to tell whether it answers, and whether a restarted
one is ready.

Gateway: `GET /health` answering with its pid (a gateway sharing the service's port with
others, at the loopback port of its own its ready file names); engine: `GET /health`; router, proxies and
agent workers: `GET /metrics` on the metrics port of their ready file (a SIGSTOPped process
answers nothing there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_cli import supervisor
from areal_cli.components import Component, connect_host, http_url
from areal_cli.http import gateway_healthy

# Engines answer /health slowly under load (CPU engines especially): they need this many
# times `hung_after` failed probes before they count as hung.
ENGINE_HUNG_FACTOR = 4
PROBE_TIMEOUT = 2.0


def ready_path(argv: list[str]) -> Path | None:
    """The `--ready-file` of a command line."""
    for i, a in enumerate(argv[:-1]):
        if a == "--ready-file":
            return Path(argv[i + 1])
    return None


def ready_info(comp: Component) -> dict[str, Any] | None:
    path = ready_path(comp.argv)
    return supervisor.read_ready_file(path) if path else None


def gateway_url(comp: Component, info: dict[str, Any] | None = None) -> str:
    """Where this one gateway process answers. Gateways sharing a port (`--gateways N`):
    the shared port may reach any of them, so its own loopback port from its ready file
    (`info`, else read now); "" while that file is not this process's yet."""
    if comp.meta.get("shared"):
        info = ready_info(comp) if info is None else info
        own = int((info or {}).get("own_port") or 0)
        if not own or (info or {}).get("pid") != comp.pid:
            return ""
        return http_url("127.0.0.1", own)
    port = int((info or {}).get("port") or comp.port)
    return http_url(comp.host, port) if port else ""


def default_probe(comp: Component, s: dict[str, Any]) -> bool | None:
    """True: answers; False: does not; None: nothing to ask (counts as fine)."""
    if comp.role == "gateway":
        url = gateway_url(comp)
        return gateway_healthy(url, comp.pid, timeout=PROBE_TIMEOUT) if url else False
    if comp.role == "engine":
        url = comp.meta.get("url", "")
        return supervisor.http_ok(url + "/health", timeout=PROBE_TIMEOUT) if url else None
    info = ready_info(comp)
    if not info or info.get("pid") != comp.pid:
        return None
    mport = int(info.get("metrics_port") or 0)
    if mport <= 0:
        return None
    host = connect_host(str(info.get("host") or comp.host))
    return supervisor.http_ok(http_url(host, mport) + "/metrics", PROBE_TIMEOUT)


def restart_ready(comp: Component, info: dict[str, Any] | None) -> bool:
    """A restarted component is ready: an engine answers `/health`; the others wrote their
    ready file with the new pid and a port (a gateway also answers `/health` with it)."""
    if comp.role == "engine":
        url = comp.meta.get("url", "")
        return bool(url) and supervisor.http_ok(url + "/health", timeout=PROBE_TIMEOUT)
    if not info or info.get("pid") != comp.pid or not info.get("port"):
        return False
    if comp.role == "gateway":
        url = gateway_url(comp, info)
        return bool(url) and gateway_healthy(url, comp.pid, timeout=PROBE_TIMEOUT)
    return True
