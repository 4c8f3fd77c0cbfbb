"""What the watchdog asks a component to tell whether it answers, and whether a restarted
one is ready.

Gateway: `GET /health` answering with its pid (a gateway sharing the service's port with
others, at the loopback port of its own its ready file names); engine: `GET /health`; router, proxies and
agent workers: `GET /metrics` on the metrics port of their ready file (a SIGSTOPped process
answers nothing there).

An engine whose `/health` does not answer is still fine while its data proxy vouches for it
(`areal_proxy_engine_healthy 1` on the proxy's metrics): a busy engine answers its health
check late (SGLang's generates a token of its own, behind a long prefill or a big batch),
and the proxy, which sees its tokens, tells busy from stalled (the proxy's
engine/progress.py). Restarting an engine that was only busy failed every request on it.
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
        if not url:
            return None
        return supervisor.http_ok(url + "/health", timeout=PROBE_TIMEOUT) or engine_vouched(url, s)
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


def engine_vouched(engine_url: str, s: dict[str, Any]) -> bool:
    """The data proxy in front of `engine_url` reports its engine healthy (making progress,
    perhaps busy). False when no live proxy of the service names that engine or it does not
    answer."""
    for d in (s.get("components") or {}).values():
        proxy = Component.from_dict(d)
        if proxy.role != "proxy":
            continue
        info = ready_info(proxy)
        if not info or info.get("pid") != proxy.pid or info.get("engine_url") != engine_url:
            continue
        mport = int(info.get("metrics_port") or 0)
        if mport <= 0:
            return False
        host = connect_host(str(info.get("host") or proxy.host))
        text = _http_text(http_url(host, mport) + "/metrics", PROBE_TIMEOUT)
        return text is not None and _gauge(text, "areal_proxy_engine_healthy") == 1.0
    return False


def _gauge(text: str, name: str) -> float | None:
    """An unlabelled sample's value in Prometheus text."""
    prefix = name + " "
    for line in text.splitlines():
        if line.startswith(prefix):
            try:
                return float(line[len(prefix) :])
            except ValueError:
                return None
    return None


def _http_text(url: str, timeout: float) -> str | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace") if 200 <= r.status < 300 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None
