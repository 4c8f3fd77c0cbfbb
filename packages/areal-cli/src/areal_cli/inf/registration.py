"""`areal inf register`, `deregister` and `models`: a model's replicas on a running service
(launch.py starts them; this module adds, removes and lists them through the gateway)."""

from __future__ import annotations

from typing import Any

from areal_cli import state as st
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message
from areal_cli.inf.launch import (
    DEFAULT_LAUNCH_TIMEOUT,
    GROUP,
    ModelOptions,
    register_with_gateway,
    resolve_model,
    start_model,
)
from areal_cli.launcher import Launcher, fail_launch, progress, resolve_binary, stop_signals
from areal_cli.lifecycle import print_table, require_state
from areal_cli.reconcile import components, gateway_alive, terminate_components


def running_service(service: str) -> tuple[dict[str, Any], str, str]:
    """The service's state, its gateway URL and admin key; CLIError unless a gateway lives."""
    s = require_state(GROUP, service)
    url = (s.get("gateway") or {}).get("url", "")
    if not gateway_alive(s) or not url:
        raise CLIError(
            f"inf service '{service}' is not running (its gateway is dead); "
            f"start it again with `areal inf run --service {service} --force`"
        )
    key = admin_key(service)
    return s, url, key


def admin_key(service: str) -> str:
    key = st.load_secrets(GROUP, service).get("admin_api_key")
    if not key:
        raise CLIError(
            f"no admin key recorded for inf service '{service}' "
            f"({st.secrets_path(GROUP, service)} is missing)"
        )
    return key


def register(cfg: Config, service: str | None, opts: ModelOptions) -> int:
    service = st.check_name("service", cfg.pick(service, "default", "service", "default"))
    spec = resolve_model(cfg, opts, "--model-name")
    proxy_bin = resolve_binary(cfg, "proxy")
    with st.locked(GROUP, service):
        s, url, key = running_service(service)
        if spec.name in (s.get("models") or {}):
            raise CLIError(f"model '{spec.name}' is already registered on inf service '{service}'")
        token = st.load_secrets(GROUP, service).get("internal_token", "")
        launcher = Launcher(GROUP, service, s, {"AREAL_INTERNAL_TOKEN": token})
        lopts = {
            "log_level": s.get("log_level", "info"),
            "launch_timeout": float(s.get("launch_timeout", DEFAULT_LAUNCH_TIMEOUT)),
        }
        try:
            with stop_signals():
                record = start_model(launcher, spec, proxy_bin, lopts)
                register_with_gateway(url, key, record, spec.admission)
                launcher.save()
        except BaseException as e:
            fail_launch(launcher, e, "register", lambda: _forget_model(launcher, spec.name))
    print(
        f"model '{spec.name}' registered on inf service '{service}' "
        f"({record['backend']}, {len(record['replicas'])} replica(s), {launcher.elapsed():.1f}s)"
    )
    return 0


def _forget_model(launcher: Launcher, name: str) -> None:
    launcher.state.get("models", {}).pop(name, None)
    launcher.save()


def deregister(cfg: Config, service: str | None, name: str, grace: float = 10.0) -> int:

    service = st.check_name("service", cfg.pick(service, "default", "service", "default"))
    st.check_name("model", name)
    with st.locked(GROUP, service, wait=5):
        s, url, key = running_service(service)
        record = (s.get("models") or {}).get(name)
        status, payload = call("DELETE", f"{url}/admin/models/{name}", key=key, timeout=30)
        if status == 404 and record is None:
            raise CLIError(f"model '{name}' is not registered on inf service '{service}'")
        if status not in (200, 204, 404):
            raise CLIError(
                f"gateway refused to deregister model '{name}': HTTP {status}: "
                f"{error_message(payload)}"
            )
        stopped = 0
        if record is not None:
            comps = components(s)
            names = [n for r in record["replicas"] for n in (r["data_proxy"], r["worker"])]
            mine = [comps[n] for n in names if n in comps]
            survivors = terminate_components(mine, grace=grace)
            if survivors:
                raise CLIError(f"could not stop {', '.join(survivors)}; state kept")
            for n in names:
                s["components"].pop(n, None)
                (st.run_dir(GROUP, service) / f"{n}.ready").unlink(missing_ok=True)
            s["models"].pop(name, None)
            st.save(GROUP, service, s)
            stopped = len(mine)
    print(f"model '{name}' deregistered from inf service '{service}' ({stopped} processes stopped)")
    return 0


def models(cfg: Config, service: str | None, as_json: bool) -> int:
    import json

    service = st.check_name("service", cfg.pick(service, "default", "service", "default"))
    s = require_state(GROUP, service)
    comps = components(s)
    url = (s.get("gateway") or {}).get("url", "")
    live: dict[str, dict[str, Any]] = {}
    gateway_error = ""
    if gateway_alive(s) and url:
        try:
            status, payload = call("GET", url + "/admin/models", key=admin_key(service), timeout=5)
            if status == 200 and isinstance(payload, dict):
                live = {
                    str(m.get("name")): m for m in payload.get("models", []) if isinstance(m, dict)
                }
            else:
                gateway_error = f"HTTP {status}: {error_message(payload)}"
        except CLIError as e:
            gateway_error = e.message
    else:
        gateway_error = "gateway is not running"
    out = []
    recorded = s.get("models") or {}
    for name in sorted(set(recorded) | set(live)):
        rec, g = recorded.get(name), live.get(name)
        workers = (g or {}).get("workers", [])
        replicas = []
        for r in (rec or {}).get("replicas", []):
            w, p = comps.get(r.get("worker", "")), comps.get(r.get("data_proxy", ""))
            replicas.append(
                {
                    "rank": r.get("rank"),
                    "gpus": r.get("gpus", []),
                    "worker": r.get("worker"),
                    "worker_alive": bool(w and w.alive()),
                    "data_proxy": r.get("data_proxy"),
                    "data_proxy_alive": bool(p and p.alive()),
                    "address": r.get("address"),
                    "engine_url": r.get("engine_url"),
                    "retired": bool(r.get("retired")),
                }
            )
        out.append(
            {
                "name": name,
                "kind": (g or {}).get("kind") or (rec or {}).get("kind", "internal"),
                "backend": (rec or {}).get("backend"),
                "model_path": (rec or {}).get("model_path"),
                "registered": g is not None,
                "managed": rec is not None,
                "base_url": (g or {}).get("base_url"),
                "replicas": replicas,
                "workers": workers,
            }
        )
    if as_json:
        doc: dict[str, Any] = {"service": service, "models": out}
        if gateway_error:
            doc["gateway_error"] = gateway_error
        print(json.dumps(doc, indent=2))
        return 0
    if gateway_error:
        progress(f"warning: could not list models from the gateway: {gateway_error}")
    if not out:
        print(f"no models registered on inf service '{service}'")
        return 0
    rows = []
    for m in out:
        healthy = sum(1 for w in m["workers"] if str(w.get("health", "")).lower() == "healthy")
        serving = [r for r in m["replicas"] if not r["retired"]]
        retired = len(m["replicas"]) - len(serving)
        alive = sum(1 for r in serving if r["worker_alive"] and r["data_proxy_alive"])
        n = len(serving) or len(m["workers"])
        rows.append(
            [
                m["name"],
                m["kind"],
                m["backend"] or m["base_url"] or "-",
                f"{alive}/{n} alive"
                + (f", {healthy} healthy" if m["workers"] else "")
                + (f", {retired} retired" if retired else ""),
                "yes" if m["registered"] else "no",
            ]
        )
    print_table(["MODEL", "KIND", "BACKEND", "REPLICAS", "IN GATEWAY"], rows)
    return 0


__all__ = ["ModelOptions", "admin_key", "deregister", "models", "register", "running_service"]
