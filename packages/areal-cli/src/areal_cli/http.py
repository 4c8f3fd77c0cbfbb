"""Small JSON-over-HTTP calls to a gateway (stdlib only: no import cost at start)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from areal_cli.errors import CLIError


def call(
    method: str,
    url: str,
    *,
    key: str | None = None,
    body: Any = None,
    timeout: float = 10.0,
) -> tuple[int, Any]:
    """(status, parsed JSON or text); a CLIError when nothing answers."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CLIError(f"{method} {url} failed: {reason}") from None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def error_message(payload: Any) -> str:
    """The message of an OpenAI-shaped error body, or the body itself."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
    return str(payload)[:300]


# A gateway that works answers /health 200 with one of these; "degraded" is the service behind
# it (a model short of healthy replicas, the router not answering), not the gateway, so the
# watchdog must not restart it for that.
GATEWAY_UP = ("ok", "degraded")


def gateway_health(url: str, pid: int, timeout: float = 1.0) -> dict[str, Any] | None:
    """The /health body of the gateway at `url` when it is *our* process `pid` and up (200,
    status ok or degraded), else None."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            if r.status != 200:
                return None
            data = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("status") in GATEWAY_UP and data.get("pid") == pid:
        return data
    return None


def gateway_healthy(url: str, pid: int, timeout: float = 1.0) -> bool:
    """True only when the gateway at `url` answers /health as *our* process `pid`."""
    return gateway_health(url, pid, timeout) is not None
