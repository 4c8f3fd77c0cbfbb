"""A data proxy that answers at a new address: tell the router (through the gateway's admin
API) and record where it is now.

Two ways a proxy moves: the watchdog restarted it on a new port (its old one was taken), or,
on a cluster, Ray placed its unit host again on another node (its node was lost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_cli import state as st
from areal_cli.components import Component
from areal_cli.errors import CLIError
from areal_cli.http import call
from areal_cli.reconcile import components, locked_state, service_gone


def reregister(
    group: str,
    service: str,
    s: dict[str, Any],
    comp: Component,
    address: str,
    log: Callable[[str], None],
) -> None:
    """Register the proxy `comp` at `address` with the router, and record the address in
    `s` (the caller saves it)."""
    url = (s.get("gateway") or {}).get("url", "")
    key = st.load_secrets(group, service).get("admin_api_key", "")
    pid = comp.meta.get("proxy_id") or comp.name
    try:
        if group == "agent":
            call(
                "POST",
                url + "/admin/pairs",
                key=key,
                timeout=10,
                body={"proxy_id": pid, "address": address},
            )
            for p in s.get("pairs", []):
                if p.get("proxy") == comp.name:
                    p["address"] = address
        else:
            model = comp.meta.get("model", "")
            call(
                "POST",
                f"{url}/admin/models/{model}/proxies",
                key=key,
                timeout=10,
                body={"proxy_id": pid, "address": address},
            )
            for r in (s.get("models") or {}).get(model, {}).get("replicas", []):
                if r.get("data_proxy") == comp.name:
                    r["address"] = address
    except CLIError as e:
        log(f"watchdog: re-registering {comp.name} at {address} failed: {e}")


def follow_moves(
    group: str, service: str, instance: str | None, log: Callable[[str], None]
) -> None:
    """On a cluster: a proxy whose host Ray placed again (its node was lost) answers at a
    new address; re-register it there and record where it is now."""
    try:
        s = st.load(group, service)
    except CLIError:
        return
    if s is None or service_gone(s, instance):
        return
    comps = components(s)  # asks the hosts (in place on `s`)
    moved = [
        c
        for c in comps.values()
        if c.remote
        and c.meta.get("live")
        and c.role == "proxy"
        and c.meta.get("live_address")
        and c.meta["live_address"] != c.meta.get("address")
    ]
    if not moved:
        return
    with locked_state(group, service, instance, wait=5.0) as cur:
        if cur is None:
            return
        for c in moved:
            address = c.meta["live_address"]
            log(f"watchdog: {c.name} now runs on {c.meta.get('node')} at {address}")
            reregister(group, service, cur, c, address, log)
            rec = cur["components"].get(c.name)
            if rec is None:
                continue
            node = c.meta.get("node", "")
            for name, d in cur["components"].items():
                m = d.get("meta") or {}
                if m.get("actor") != c.meta["actor"]:
                    continue
                now_id = s["components"][name]["meta"].get("node_id")
                if now_id and now_id != m.get("node_id"):
                    m["moves"] = int(m.get("moves", 0)) + 1  # another node, not a restart
                m["node"], m["node_id"], d["host"] = node, now_id, node
            rec["meta"]["address"] = address
            rec["port"] = int(address.rsplit(":", 1)[1])
        st.save(group, service, cur)
