"""A model's admission bounds at `areal inf run --model` / `register` (flags over
[register.internal]), set through the gateway's admin API once the model is registered; and
what `areal inf status` shows of them (docs/services.md, "Admission").

The router keeps the bounds in its state file, so a restarted router (the watchdog's) keeps
them; nothing is kept in the CLI's state.
"""

from __future__ import annotations

from typing import Any

from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message

# (key in [register.internal] and the admin API, its flag, the least value).
BOUNDS: tuple[tuple[str, str, int], ...] = (
    ("max_staleness", "--max-staleness", 0),
    ("batch_size", "--batch-size", 1),
    ("max_concurrent_rollouts", "--max-concurrent-rollouts", 1),
)


def resolve(cfg: Config, given: dict[str, int | None]) -> dict[str, int]:
    """The bounds set for a model: each flag given, else its [register.internal] key; the
    unset ones left out (no bound). Checked here, so a bad value stops before any engine
    starts."""
    out: dict[str, int] = {}
    for key, flag, least in BOUNDS:
        value = cfg.pick(given.get(key), "register.internal", key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise CLIError(f"{flag} must be an integer >= {least}, got {value!r}", code=2)
        out[key] = value
    if ("max_staleness" in out) != ("batch_size" in out):
        raise CLIError(
            "--max-staleness and --batch-size go together (the staleness bound is "
            "(max_staleness + version + 1) x batch_size): give both or neither",
            code=2,
        )
    return out


def apply(gateway_url: str, key: str, model: str, bounds: dict[str, int]) -> None:
    """Set `bounds` on a registered model (nothing to do when none is set)."""
    if not bounds:
        return
    url = f"{gateway_url.rstrip('/')}/admin/models/{model}/admission"
    status, payload = call("PUT", url, key=key, body=bounds, timeout=30)
    if status != 200:
        raise CLIError(
            f"gateway refused the admission bounds of model '{model}': HTTP {status}: "
            f"{error_message(payload)}"
        )


def fetch(gateway_url: str, key: str) -> dict[str, dict[str, Any]]:
    """Per model, its admission state (`GET /admin/admission`): {} when the gateway does not
    answer (status shows what it can)."""
    try:
        status, payload = call(
            "GET", gateway_url.rstrip("/") + "/admin/admission", key=key, timeout=1.0
        )
    except CLIError:
        return {}
    models = payload.get("models") if status == 200 and isinstance(payload, dict) else None
    return {str(m.get("model")): m for m in models or [] if isinstance(m, dict)}


def describe(st: dict[str, Any]) -> list[str]:
    """One status row: model, version, running, ended, consumed, capacity left, bounds."""
    bounds = [f"{k}={st[k]}" for k, _, _ in BOUNDS if st.get(k) is not None]
    left = st.get("capacity_left")
    cap = "unbounded" if left is None else f"{left} ({st.get('limited_by')})"
    return [
        str(st.get("model")),
        str(st.get("version")),
        str(st.get("running")),
        str(st.get("ended")),
        str(st.get("consumed")),
        str(st.get("waiting")),
        cap,
        ", ".join(bounds) or "none",
    ]


HEADERS = ["MODEL", "VERSION", "RUNNING", "ENDED", "CONSUMED", "WAITING", "CAPACITY LEFT"]
HEADERS += ["BOUNDS"]
