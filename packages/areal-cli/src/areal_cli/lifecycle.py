"""`ps`, `status` and `stop`, shared by `areal inf` and `areal agent`.

A service state records components (components.Component dicts) keyed by name;
each has `meta.role` in {gateway, router, engine, proxy, worker, watchdog}. Everything
here works from the state file and the processes (reconcile.py), so it is the same for
both groups. The top of the process layer: nothing of it imports this module.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.cluster import ray_scheduler
from areal_cli.components import Component, http_url, sup_info
from areal_cli.errors import CLIError
from areal_cli.probes import gateway_url
from areal_cli.reconcile import comp_state as comp_state
from areal_cli.reconcile import components as components
from areal_cli.reconcile import service_status as service_status
from areal_cli.reconcile import stop_tiers as stop_tiers
from areal_cli.reconcile import terminate_components as terminate_components

# `X as X` above: reconcile.py holds them; kept here for the code that reaches them as
# `lifecycle.X`.

DEFAULT_GRACE = 10.0


def describe(comp: Component) -> dict[str, Any]:
    alive = comp.alive()
    sup = sup_info(comp)
    d: dict[str, Any] = {
        "name": comp.name,
        "role": comp.meta.get("role", ""),
        "status": "running" if alive else "dead",
        "state": comp_state(comp, alive),
        "restarts": int(sup.get("restarts") or 0),
        "last_failure": sup.get("last_failure"),
        "alive": alive,
        "pid": comp.pid,
        "pgid": comp.pgid,
        "host": comp.host,
        "port": comp.port,
        "log": comp.log,
        "argv": comp.argv,
    }
    for key in ("url", "address", "model", "rank", "proxy_id", "started_at", "gpus"):
        if key in comp.meta:
            d[key] = comp.meta[key]
    if d["role"] == "gateway" and comp.meta.get("shared"):
        # One of several on the service's port: where this one process answers.
        d["own_url"] = gateway_url(comp) if alive else ""
    d["metrics_url"] = metrics_url(comp)
    # Where it runs: this machine, or the cluster node its host is on (and its pid there).
    d["node"] = comp.meta.get("node") or "local"
    if comp.remote:
        d["pid"] = comp.meta.get("remote_pid", 0)
        d["moves"] = int(sup.get("moves") or 0)
        if comp.meta.get("live_address"):
            d["address"] = comp.meta["live_address"]
    return d


def metrics_url(comp: Component) -> str | None:
    """Where its Prometheus metrics are scraped: a gateway's `/metrics` on its own port; a
    router's, proxy's or agent worker's metrics port from its ready file; None for an engine
    (SGLang serves them only with `--enable-metrics`, on its own port), the watchdog, or a
    component on another node (its ready file is there)."""
    role = comp.meta.get("role", "")
    if comp.remote and role == "gateway":  # on another node, at that node's address
        return f"{comp.meta['url']}/metrics" if comp.meta.get("url") else None
    if comp.remote or role in ("engine", "watchdog", "guard"):
        return None
    if role == "gateway":
        # A shared port would answer with any gateway's metrics: its own port, when shared.
        url = gateway_url(comp) if comp.meta.get("shared") else comp.meta.get("url")
        url = url or (http_url(comp.host, comp.port) if comp.port else "")
        return f"{url}/metrics" if url else None
    argv = comp.argv
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--ready-file"), None)
    info = supervisor.read_ready_file(Path(path)) if path else None
    port = int((info or {}).get("metrics_port") or 0)
    if port <= 0 or (info or {}).get("pid") != comp.pid:
        return None
    return http_url(str((info or {}).get("host") or comp.host), port) + "/metrics"


def require_state(group: str, service: str) -> dict[str, Any]:
    s = st.load(group, service)
    if s is None:
        known = st.list_services(group)
        hint = f" (known: {', '.join(known)})" if known else f" (no {group} services are recorded)"
        raise CLIError(f"no {group} service named '{service}'{hint}")
    return s


def stop(
    group: str, service: str, *, force: bool, grace: float, keep_state: bool, quiet: bool = False
) -> int:
    st.check_name("service", service)
    with st.locked(group, service, wait=max(5.0, grace + 5.0)):
        s = require_state(group, service)
        comps = list(components(s).values())
        t0 = time.monotonic()
        survivors = terminate_components(comps, grace=grace, force=force)
        if s.get("scheduler") == "ray":
            address = (s.get("ray") or {}).get("ray_address", "auto")
            survivors += ray_scheduler.sweep(address, group, service, grace=grace, force=force)
        took = time.monotonic() - t0
        if survivors:
            raise CLIError(
                f"could not stop {', '.join(survivors)} of {group} service '{service}'; "
                "state kept so you can retry"
            )
        if keep_state:
            s["phase"] = "stopped"
            s["stopped_at"] = time.time()
            st.save(group, service, s)
        else:
            st.remove(group, service)
    if not quiet:
        how = "killed" if force else "stopped"
        kept = " (state kept)" if keep_state else ""
        print(f"{group} service '{service}' {how}: {len(comps)} components in {took:.1f}s{kept}")
    return 0


# ---------------------------------------------------------------------- ps / status


def ps_rows(group: str, *, include_stale: bool) -> list[dict[str, Any]]:
    rows = []
    for name, s in st.load_all(group).items():
        comps = components(s)
        status = service_status(s, comps)
        if status in ("stale", "stopped") and not include_stale:
            continue
        states = {n: comp_state(c) for n, c in comps.items()}
        dead = sorted(n for n, c in comps.items() if not c.alive())
        row: dict[str, Any] = {
            "service": name,
            "status": status,
            "gateway": (s.get("gateway") or {}).get("url", ""),
            # Every gateway process of the service (several share the port: --gateways N).
            "gateways": {n: states[n] for n, c in comps.items() if c.role == "gateway"},
            # Every address clients reach a gateway at: the service's port on the CLI's
            # node, then each gateway on another node ([scheduler] gateway_nodes).
            "gateway_urls": _gateway_urls(s, comps),
            "components": len(comps),
            "dead": dead,
            "restarting": sorted(n for n, v in states.items() if v == "restarting"),
            "failed": sorted(n for n, v in states.items() if v == "failed"),
            "restarts": sum(
                int((c.meta.get("supervision") or {}).get("restarts") or 0) for c in comps.values()
            ),
            "supervised": bool((s.get("supervision") or {}).get("enabled")),
            "foreground": bool((s.get("owner") or {}).get("foreground")),
            "created_at": s.get("created_at"),
        }
        if group == "inf":
            row["models"] = sorted(s.get("models") or {})
        else:
            row["agent"] = s.get("agent", "")
        rows.append(row)
    return rows


def _gateway_urls(s: dict[str, Any], comps: dict[str, Component]) -> list[str]:
    urls = [(s.get("gateway") or {}).get("url", "")]
    urls += [c.meta.get("url", "") for c in comps.values() if c.role == "gateway" and c.remote]
    return [u for u in dict.fromkeys(urls) if u]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*headers).rstrip())
    for r in rows:
        print(fmt.format(*r).rstrip())


def ps(group: str, *, as_json: bool, include_stale: bool) -> int:
    rows = ps_rows(group, include_stale=include_stale)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no {group} services" + ("" if include_stale else " running (--all shows stale)"))
        return 0
    last = "MODELS" if group == "inf" else "AGENT"
    table = []
    for r in rows:
        status = r["status"]
        if r["status"] == "degraded":
            parts = [f"{', '.join(r[k])} {k}" for k in ("failed", "restarting") if r[k]]
            dead = [n for n in r["dead"] if n not in r["restarting"] and n not in r["failed"]]
            if dead:
                parts.append(f"{', '.join(dead)} dead")
            status += f" ({'; '.join(parts)})"
        extra = ",".join(r["models"]) if group == "inf" else r["agent"]
        gateway = ",".join(r["gateway_urls"]) or "-"
        if len(r["gateways"]) > 1:
            up = sum(v == "running" for v in r["gateways"].values())
            gateway += f" ({up}/{len(r['gateways'])} gateways)"
        table.append([r["service"], status, gateway, extra or "-"])
    print_table(["SERVICE", "STATUS", "GATEWAY", last], table)
    return 0


def status_doc(group: str, service: str, *, probe: bool = True) -> dict[str, Any]:
    """The `status --json` document: `.gateway.url`, `.router`, per-model or per-pair objects."""
    # urllib (http.client, ssl) only here: `ps` and `stop` start faster without it.
    from areal_cli.http import gateway_health

    s = require_state(group, service)
    comps = components(s)
    described = {n: describe(c) for n, c in comps.items()}
    # On a cluster, what runs beside the CLI is on the CLI's node.
    here = (s.get("ray") or {}).get("driver_node", "")
    for c in described.values():
        if c["node"] == "local" and here:
            c["node"] = here
    doc: dict[str, Any] = {
        "service": service,
        "group": group,
        "status": service_status(s, comps),
        "scheduler": s.get("scheduler", "local"),
        "created_at": s.get("created_at"),
        "foreground": bool((s.get("owner") or {}).get("foreground")),
        "supervision": _supervision(s, described),
    }
    gateways = [c for c in described.values() if c.get("role") == "gateway"]
    body = None
    for g in gateways:
        # Each gateway at the address only it answers on (the shared port reaches any).
        # One on another node: at its node's address (`url`).
        at = g.get("own_url") or g.get("url") or (s.get("gateway") or {}).get("url", "")
        health = gateway_health(at, g["pid"], timeout=1.0) if probe and g.get("alive") else None
        g["healthy"] = health is not None
        body = body or health
    gw = dict(described.get("gateway") or {})
    gw["url"] = (s.get("gateway") or {}).get("url", "")
    # The service's port answers while any of its gateways does.
    gw["healthy"] = body is not None
    gw["gateways"] = len(gateways)
    gw["gateways_healthy"] = sum(1 for g in gateways if g.get("healthy"))
    # What the gateway's /health says of the service behind it: "ok" or "degraded", with
    # the router's per-model healthy/total replicas; None when the gateway did not answer.
    doc["serving"] = (
        {k: body[k] for k in ("status", "router", "models", "error") if k in body}
        if body is not None
        else None
    )
    doc["gateway"] = gw
    router = dict(described.get("router") or {})
    router.setdefault("address", (s.get("router") or {}).get("address", ""))
    doc["router"] = router
    if group == "inf":
        parsing = _parsing(group, service, gw["url"]) if body is not None else {}
        admitting = _admission(group, service, gw["url"]) if body is not None else {}
        models = []
        for name, m in (s.get("models") or {}).items():
            reps = []
            for r in m.get("replicas", []):
                proxy = described.get(r.get("data_proxy", ""), {})
                reps.append(
                    {
                        "rank": r.get("rank"),
                        "gpus": r.get("gpus", []),
                        "worker": described.get(r.get("worker", ""), {}),
                        "data_proxy": proxy,
                        **parsing.get(proxy.get("proxy_id") or proxy.get("name", ""), _UNKNOWN),
                    }
                )
            models.append(
                {
                    "name": name,
                    "backend": m.get("backend"),
                    "model_path": m.get("model_path"),
                    "phase": m.get("phase", "running"),
                    "replicas": reps,
                    # Weight version, sessions by state and capacity left (None: the
                    # gateway did not answer).
                    "admission": admitting.get(name),
                }
            )
        doc["models"] = models
    else:
        doc["agent"] = s.get("agent", "")
        doc["pairs"] = [
            {
                "index": p.get("index"),
                "worker": described.get(p.get("worker", ""), {}),
                "proxy": described.get(p.get("proxy", ""), {}),
            }
            for p in s.get("pairs", [])
        ]
    if s.get("scheduler") == "ray":
        ray = s.get("ray") or {}
        doc["cluster"] = {
            "address": ray.get("ray_address", ""),
            "device_resource": ray.get("device_resource", ""),
            "shared_dir": ray.get("shared_dir", ""),
            "error": s.get("cluster_error"),
        }
    doc["components"] = described
    return doc


# A replica's parsers when the gateway did not say (not answering, or the proxy unlisted).
_UNKNOWN: dict[str, Any] = {
    "tool_call_parser": None,
    "reasoning_parser": None,
    "default_tool_prompt": None,
}


def _parsing(group: str, service: str, url: str) -> dict[str, dict[str, Any]]:
    """Per proxy id, how it reads tool calls and reasoning (the router's last GetStats of it,
    via the gateway's `GET /admin/workers`): {} when the gateway does not answer."""
    from areal_cli.http import call

    key = st.load_secrets(group, service).get("admin_api_key", "")
    try:
        code, payload = call("GET", url.rstrip("/") + "/admin/workers", key=key, timeout=1.0)
    except CLIError:
        return {}
    workers = payload.get("workers") if code == 200 and isinstance(payload, dict) else None
    return {
        str(w.get("proxy_id")): {k: w.get(k) for k in _UNKNOWN}
        for w in workers or []
        if isinstance(w, dict)
    }


def _admission(group: str, service: str, url: str) -> dict[str, dict[str, Any]]:
    from areal_cli import admission

    key = st.load_secrets(group, service).get("admin_api_key", "")
    return admission.fetch(url, key)


def _supervision(s: dict[str, Any], described: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The service's supervision settings and whether a watchdog process runs them: enabled
    but with its watchdog (and the guard in its group) killed, nothing restarts anything."""
    sup = dict(s.get("supervision") or {"enabled": False})
    if sup.get("enabled"):
        dogs = [c for c in described.values() if c.get("role") == "watchdog"]
        sup["alive"] = any(c.get("alive") for c in dogs)
    return sup


def print_status(doc: dict[str, Any]) -> None:
    gw = doc["gateway"]
    print(f"service   {doc['service']} ({doc['group']}, scheduler {doc['scheduler']})")
    health = "healthy" if gw.get("healthy") else "not answering" if gw.get("alive") else "dead"
    print(f"status    {doc['status']}")
    cluster = doc.get("cluster")
    if cluster:
        shared = cluster.get("shared_dir") or "none (a lost node's sessions are lost)"
        print(
            f"cluster   ray at {cluster['address']} (devices = {cluster['device_resource']}, "
            f"shared dir {shared})"
        )
        if cluster.get("error"):
            print(f"          not reachable: {cluster['error']}")
    sup = doc.get("supervision") or {}
    if sup.get("enabled") and not sup.get("alive", True):
        print(
            "watchdog  dead (enabled, but no watchdog process runs: nothing restarts a failed "
            f"component; `areal {doc['group']} run --service {doc['service']} --force ...` "
            "starts the service again with one)"
        )
    elif sup.get("enabled"):
        print(
            f"watchdog  on (at most {sup.get('max_restarts')} restarts per "
            f"{sup.get('window', 0):g}s, backoff {sup.get('backoff_initial', 0):g}s"
            f"..{sup.get('backoff_max', 0):g}s)"
        )
    else:
        print("watchdog  off")
    if gw.get("gateways", 1) > 1:
        health += f", {gw.get('gateways_healthy', 0)} of {gw['gateways']} gateways answering"
    print(f"gateway   {gw.get('url') or '-'} ({health})")
    serving = doc.get("serving")
    if serving:
        # The gateway's /health of the service: a dead replica shows here, not only as 503s.
        models = serving.get("models") or {}
        counts = ", ".join(
            f"{name} {c.get('healthy', 0)}/{c.get('total', 0)} replicas healthy"
            for name, c in models.items()
        )
        router = serving.get("router", "unknown")
        detail = counts if router == "ok" else f"router {router}"
        print(f"serving   {serving.get('status', '-')}" + (f" ({detail})" if detail else ""))
    if doc["group"] == "inf":
        names = ", ".join(m["name"] for m in doc["models"]) or "-"
        print(f"models    {names}")
    else:
        print(f"agent     {doc.get('agent') or '-'}")
    print()
    rows = []
    for c in doc["components"].values():
        addr = (
            c.get("url") or c.get("address") or (f"{c['host']}:{c['port']}" if c["port"] else "-")
        )
        last = c.get("last_failure") or {}
        failure = "-"
        if last.get("reason"):
            at = time.strftime("%H:%M:%S", time.localtime(float(last.get("at") or 0)))
            failure = f"{at} {last['reason']}"
        restarts = str(c["restarts"]) + (f" ({c['moves']} moved)" if c.get("moves") else "")
        rows.append(
            [
                c["name"],
                c["role"],
                c["state"],
                restarts,
                c["node"],
                str(c["pid"]),
                addr,
                failure,
                c["log"],
            ]
        )
    headers = ["COMPONENT", "ROLE", "STATE", "RESTARTS", "NODE", "PID", "ADDRESS"]
    headers += ["LAST FAILURE", "LOG"]
    print_table(headers, rows)
    _print_parsing(doc)
    _print_admission(doc)


def _print_admission(doc: dict[str, Any]) -> None:
    """Per model: the weight version admission control uses, its sessions by state, and the
    capacity left (the tighter bound's room; `unbounded` without bounds)."""
    from areal_cli import admission

    rows = [
        admission.describe(m["admission"]) for m in doc.get("models") or [] if m.get("admission")
    ]
    if rows:
        print()
        print_table(admission.HEADERS, rows)


def _print_parsing(doc: dict[str, Any]) -> None:
    """Per replica: the tool-call and reasoning parsers in force, and whether the proxy writes
    `tools` into the prompt itself (the model's chat template does not)."""
    rows = []
    for m in doc.get("models") or []:
        for r in m.get("replicas") or []:
            if r.get("tool_call_parser") is None:
                continue  # the gateway did not say
            name = (r.get("data_proxy") or {}).get("name", "-")
            prompt = "yes" if r.get("default_tool_prompt") else "no"
            parsers = [r["tool_call_parser"] or "none", r.get("reasoning_parser") or "none"]
            rows.append([name, m["name"], *parsers, prompt])
    if rows:
        print()
        headers = ["REPLICA", "MODEL", "TOOL-CALL PARSER", "REASONING PARSER"]
        print_table([*headers, "DEFAULT TOOL PROMPT"], rows)


def status(group: str, service: str, *, as_json: bool, watch: bool, interval: float) -> int:
    st.check_name("service", service)
    if interval <= 0:
        raise CLIError("--interval must be positive", code=2)
    while True:
        doc = status_doc(group, service)
        if as_json:
            print(json.dumps(doc, indent=2), flush=True)
        else:
            if watch and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print_status(doc)
            if watch:
                print(f"\n(every {interval:g}s; Ctrl-C to quit)", flush=True)
        if not watch:
            return 0
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0
