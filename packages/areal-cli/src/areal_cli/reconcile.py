"""A service's recorded components against what runs: each one's state, the service's
status, and stopping them in tiers.

Shared by `areal inf` and `areal agent`, and by everything of the process layer that
reads a service state (launcher, watchdog, lifecycle). It works from the state file and
the processes themselves, or, on a cluster, from what the unit hosts say (through
cluster/ray_scheduler.py, which imports Ray only when a service runs on one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.cluster import ray_scheduler
from areal_cli.components import Component, sup_state
from areal_cli.errors import CLIError

# Stop order: the watchdog first (so nothing is restarted), then data proxies, then
# engines / agent workers, then gateway, then router.
STOP_TIERS = (("watchdog",), ("proxy",), ("engine", "worker"), ("gateway",), ("router",))


def components(state: dict[str, Any]) -> dict[str, Component]:
    """The recorded components; on a cluster, with what their hosts say of them now."""
    if state.get("scheduler") == "ray":
        try:
            ray_scheduler.refresh(state)
        except CLIError as e:
            # The cluster is not reachable: its components read as dead, and say why.
            state["cluster_error"] = e.message
    return {n: Component.from_dict(d) for n, d in (state.get("components") or {}).items()}


def owner_alive(state: dict[str, Any]) -> bool:
    o = state.get("owner") or {}
    return (
        bool(o) and Component("owner", o.get("pid", 0), 0, o.get("start_time", -1), [], "").alive()
    )


def comp_state(comp: Component, alive: bool | None = None) -> str:
    """running | dead | restarting | failed (the last two recorded by the watchdog)."""
    sup = sup_state(comp)
    if sup in ("restarting", "failed"):
        return sup
    alive = comp.alive() if alive is None else alive
    return "running" if alive else "dead"


def service_status(state: dict[str, Any], comps: dict[str, Component] | None = None) -> str:
    """starting | running | degraded (a component not running) | stale (no gateway left) |
    stopped.

    A gateway the watchdog is restarting makes the service degraded, not stale; so does one
    of several gateways dead (the others serve the port).
    """
    if state.get("phase") == "stopped":
        return "stopped"
    comps = components(state) if comps is None else comps
    states = {n: comp_state(c) for n, c in comps.items()}
    if state.get("phase") == "starting" and owner_alive(state):
        return "starting"
    gw = [n for n, c in comps.items() if c.role == "gateway"]
    if not any(states[n] in ("running", "restarting") for n in gw):
        return "stale"
    return "running" if all(v == "running" for v in states.values()) else "degraded"


def gateway_alive(state: dict[str, Any]) -> bool:
    """Any of the service's gateways is alive (several share its port: --gateways N)."""
    return any(c.role == "gateway" and c.alive() for c in components(state).values())


def stop_tiers(comps: list[Component]) -> list[list[Component]]:
    tiers: list[list[Component]] = []
    seen: set[str] = set()
    for roles in STOP_TIERS:
        tier = [c for c in comps if c.role in roles]
        seen.update(c.name for c in tier)
        tiers.append(tier)
    rest = [c for c in comps if c.name not in seen]
    if rest:
        tiers.insert(0, rest)
    return [t for t in tiers if t]


def terminate_components(
    comps: list[Component], *, grace: float, force: bool = False, procs: dict | None = None
) -> list[str]:
    """Stop `comps` in tier order; the names of any that survived.

    Components on a cluster go first, through their hosts (each host stops its proxy,
    then its engine), then the local tiers."""
    remote = [c for c in comps if c.remote]
    survivors: list[str] = []
    if remote:
        survivors = ray_scheduler.stop_remote(remote, grace=grace, force=force)
    local = [c for c in comps if not c.remote]
    supervisor.terminate(stop_tiers(local), grace=grace, force=force, procs=procs)
    return survivors + [c.name for c in local if supervisor.group_alive(c)]


def service_gone(state: dict[str, Any] | None, instance: str | None) -> bool:
    """The service is stopped, or (with `instance`) replaced by a newer `run`."""
    if state is None or state.get("phase") == "stopped":
        return True
    return instance is not None and state.get("instance") != instance


@contextlib.contextmanager
def locked_state(
    group: str, service: str, instance: str | None, wait: float = 0.0
) -> Iterator[dict[str, Any] | None]:
    """The service state under its lock; None when the lock is busy after `wait` seconds
    or the service is gone (for the watchdog and its guard, which never block a command)."""
    lock = st.Lock(group, service)
    try:
        lock.acquire(wait)
    except CLIError:
        yield None
        return
    try:
        s = st.load(group, service)
        yield None if service_gone(s, instance) else s
    finally:
        lock.release()
