"""Supervision of a running service: restart dead or hung components.

No typer here. The foreground `run` calls `Watchdog.tick()` in its loop; with
`--detach` the same loop runs as a recorded component of the service:

    python -m areal_cli.watchdog --group inf --service NAME

(own process group, log `watchdog.log`, pid identity like every component;
`stop` stops it first). The detached watchdog keeps a guard (guard.py) in its
process group that starts the watchdog again if it dies, and that it starts
again in turn.

Each tick re-reads the service state and checks every component:

* dead: the recorded process (pid + start time) is gone;
* hung: it is alive but does not answer its probe for `hung_after` checks in a
  row (gateway `GET /health` with its pid; engine `GET /health`, with a longer
  threshold, and never while its data proxy vouches for it: a busy engine answers
  late, probes.py; router, proxies and agent workers `GET /metrics` on the metrics
  port of their ready file, so a SIGSTOPped process is caught). A component is
  only probed for hangs after it has answered once since it (re)started.

A dead or hung component gets its process group killed and is respawned with
its recorded argv, environment (secrets re-read from the 0600 secrets file)
and working directory, **on its recorded port** (`--port 0` becomes the port
it had), so router registrations, the gateway's router address, a proxy's
worker address and client URLs stay valid. If that port is taken, a data
proxy gets a new one and is re-registered through the gateway admin API;
other roles retry later (gateways sharing the service's port skip the check: the others
hold it). Restarts back off exponentially (`backoff_initial`
doubling to `backoff_max`); more than `max_restarts` restarts within
`window` seconds mark the component `failed` (its group is killed, the rest
of the service stays up).

State: per component `meta.supervision = {state, restarts, last_failure:
{reason, at}}`, state one of running / restarting / failed. Every write is
made under the service lock (never waited for: a busy lock skips the tick)
and is atomic 0600 like every state write. A respawned process is recorded
before its readiness is awaited, so `stop` always finds it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.components import Component, connect_host, sup_info, sup_state
from areal_cli.errors import CLIError
from areal_cli.guard import guard_argv
from areal_cli.policy import Policy
from areal_cli.policy import policy_from_config as policy_from_config
from areal_cli.probes import (
    ENGINE_HUNG_FACTOR,
    default_probe,
    ready_info,
    ready_path,
    restart_ready,
)
from areal_cli.readdress import follow_moves, reregister
from areal_cli.reconcile import locked_state, service_gone
from areal_cli.supervisor import SECRET_ENV as SECRET_ENV

# `X as X` above: names that live elsewhere now, kept here for the code that reaches them
# as `watchdog.X`.


def with_port(argv: list[str], port: int) -> list[str]:
    """argv with the value after `--port` replaced by `port`."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--port":
            out[i + 1] = str(port)
            return out
    return out


@dataclass
class Track:
    """What the watchdog remembers of one component between ticks (not persisted)."""

    misses: int = 0  # probes failed in a row
    answered: bool = False  # answered a probe since it (re)started
    history: list[float] = field(default_factory=list)  # restart times (wall clock)
    backoff: float = 0.0
    next_at: float = 0.0  # monotonic: no restart before this
    healthy_since: float = 0.0
    pending: Any = None  # Popen of a respawn that is not ready yet
    pending_deadline: float = 0.0
    pending_pid: int = 0
    ready_info: dict[str, Any] = field(default_factory=dict)


Probe = Callable[[Component, dict[str, Any]], bool | None]


class Watchdog:
    """Checks one service each `tick()`; restarts what is dead or hung."""

    def __init__(
        self,
        group: str,
        service: str,
        *,
        instance: str | None = None,
        policy: Policy | None = None,
        probe: Probe | None = None,
        log: Callable[[str], None] | None = None,
        procs: dict[int, subprocess.Popen] | None = None,
    ) -> None:
        self.group = group
        self.service = service
        self.instance = instance
        self.policy = policy
        self.probe = probe or default_probe
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.tracks: dict[str, Track] = {}
        self.procs: dict[int, subprocess.Popen] = procs if procs is not None else {}

    # ------------------------------------------------------------------ loop

    def gone(self, s: dict[str, Any] | None) -> bool:
        return service_gone(s, self.instance)

    def run(self, max_ticks: int | None = None) -> int:
        """Tick until the service is stopped (or `max_ticks`); 0."""
        n = 0
        while max_ticks is None or n < max_ticks:
            if not self.tick():
                return 0
            n += 1
            time.sleep(self.current_policy().check_interval)
        return 0

    def current_policy(self) -> Policy:
        if self.policy is not None:
            return self.policy
        with contextlib.suppress(CLIError):
            s = st.load(self.group, self.service)
            if s is not None:
                return Policy.from_dict(s.get("supervision"))
        return Policy()

    def tick(self) -> bool:
        """One round of checks; False once the service is gone (stopped or replaced)."""
        for p in list(self.procs.values()):
            p.poll()  # reap our children so a dead one reads as dead
        try:
            s = st.load(self.group, self.service)
        except CLIError as e:
            self.log(f"watchdog: {e}")
            return True
        if self.gone(s):
            return False
        assert s is not None
        if self.instance is None:
            self.instance = s.get("instance")
        if s.get("phase") != "running":
            return True  # a launch in progress handles its own failures
        policy = self.policy or Policy.from_dict(s.get("supervision"))
        if not policy.enabled:
            return True
        now = time.monotonic()
        if s.get("scheduler") == "ray":
            follow_moves(self.group, self.service, self.instance, self.log)
        # Components on a cluster are kept alive by their hosts (areal_cli.cluster.host).
        comps = {
            n: Component.from_dict(d)
            for n, d in (s.get("components") or {}).items()
            if (d.get("meta") or {}).get("role") != "watchdog"
            and not (d.get("meta") or {}).get("actor")
        }
        for name in list(self.tracks):
            if name not in comps:
                del self.tracks[name]  # deregistered
        for name, comp in comps.items():
            tr = self.tracks.setdefault(name, Track(backoff=policy.backoff_initial))
            if sup_state(comp) == "failed":
                continue
            if tr.pending is not None:
                self._check_pending(comp, tr, policy, now)
                continue
            reason = self._diagnose(comp, s, tr, policy)
            if reason is None:
                if sup_state(comp) == "restarting" and comp.alive():
                    # Recorded as restarting by an earlier watchdog (or a lost tick): settle it.
                    self._set(name, state="running")
                if not tr.healthy_since:
                    tr.healthy_since = now
                elif now - tr.healthy_since > policy.backoff_max:
                    tr.backoff = policy.backoff_initial  # stable again: back off from the start
                continue
            tr.healthy_since = 0.0
            self._failed_check(comp, tr, policy, reason, now)
        return True

    # ------------------------------------------------------------ diagnosis

    def _diagnose(
        self, comp: Component, s: dict[str, Any], tr: Track, policy: Policy
    ) -> str | None:
        """None when fine; else why it needs a restart."""
        if not comp.alive():
            p = self.procs.get(comp.pid)
            code = (
                f" (exit code {p.returncode})" if p is not None and p.returncode is not None else ""
            )
            if sup_state(comp) == "restarting" and not tr.answered and tr.history:
                return f"restart did not come up{code}"
            return f"process exited{code}"
        ok = self.probe(comp, s)
        if ok is None or ok:
            if ok:
                tr.answered = True
            tr.misses = 0
            return None
        if not tr.answered:
            return None  # never answered since it started: still starting (e.g. a new engine)
        tr.misses += 1
        limit = policy.hung_after * (ENGINE_HUNG_FACTOR if comp.role == "engine" else 1)
        if tr.misses >= limit:
            return f"hung: no answer to {tr.misses} health checks in a row"
        return None

    def _failed_check(
        self, comp: Component, tr: Track, policy: Policy, reason: str, now: float
    ) -> None:
        info = sup_info(comp)
        last = info.get("last_failure") or {}
        if last.get("reason") != reason or sup_state(comp) != "restarting":
            if sup_state(comp) != "restarting":
                self.log(f"watchdog: {comp.name} {reason}")
            self._set(
                comp.name, state="restarting", last_failure={"reason": reason, "at": time.time()}
            )
        wall = time.time()
        recent = [t for t in tr.history if wall - t < policy.window]
        if len(recent) >= policy.max_restarts:
            self._mark_failed(comp, reason, len(recent))
            return
        if now < tr.next_at:
            return  # backing off
        self._restart(comp, tr, policy, reason, now)

    # ------------------------------------------------------------- actions

    def _mark_failed(self, comp: Component, reason: str, n: int) -> None:
        self.log(
            f"watchdog: {comp.name} failed {n} restart(s) within the window; marked failed "
            f"(last: {reason})"
        )
        with self._locked() as s:
            if s is None or comp.name not in s.get("components", {}):
                return
            cur = Component.from_dict(s["components"][comp.name])
            _kill_group(cur)
            _update(s, comp.name, state="failed")
            st.save(self.group, self.service, s)

    def _restart(self, comp: Component, tr: Track, policy: Policy, reason: str, now: float) -> None:
        with self._locked() as s:
            if s is None:
                return  # lock busy or service gone: next tick
            rec = (s.get("components") or {}).get(comp.name)
            if rec is None or rec.get("pid") != comp.pid:
                return  # changed meanwhile (deregistered, or restarted by someone else)
            cur = Component.from_dict(rec)
            _kill_group(cur)
            argv = list(cur.argv)
            port_changed = False
            if cur.port and cur.meta.get("shared"):
                # Gateways sharing the service's port: the others hold it, and that is fine.
                argv = with_port(argv, cur.port)
            elif cur.port:
                host = cur.host or "127.0.0.1"
                if supervisor.port_in_use(host, cur.port) and not _wait_port(host, cur.port, 3.0):
                    if cur.role == "proxy":
                        argv = with_port(argv, 0)
                        port_changed = True
                    else:
                        tr.history.append(time.time())
                        self._backoff(tr, policy, now)
                        _update(
                            s,
                            comp.name,
                            last_failure={
                                "reason": f"{reason}; port {cur.port} still in use",
                                "at": time.time(),
                            },
                        )
                        st.save(self.group, self.service, s)
                        return
                else:
                    argv = with_port(argv, cur.port)
            ready = ready_path(argv)
            if ready is not None:
                with contextlib.suppress(FileNotFoundError):
                    ready.unlink()
            try:
                proc, new = supervisor.respawn(
                    self.group, self.service, cur, argv, port=0 if port_changed else cur.port
                )
            except supervisor.LaunchError as e:
                tr.history.append(time.time())
                self._backoff(tr, policy, now)
                _update(s, comp.name, last_failure={"reason": e.reason, "at": time.time()})
                st.save(self.group, self.service, s)
                return
            self.procs[proc.pid] = proc
            restarts = int(sup_info(cur).get("restarts") or 0) + 1
            new.meta["restarted_at"] = time.time()
            new.meta["supervision"] = {
                **sup_info(cur),
                "state": "restarting",
                "restarts": restarts,
                "last_failure": {"reason": reason, "at": time.time()},
            }
            s["components"][comp.name] = new.to_dict()
            st.save(self.group, self.service, s)
        self.log(f"watchdog: restarting {comp.name} (attempt {restarts}, pid {proc.pid})")
        tr.history.append(time.time())
        tr.pending = proc
        tr.pending_pid = proc.pid
        tr.pending_deadline = now + self._ready_timeout(s, cur)
        tr.misses = 0
        tr.answered = False
        tr.ready_info = {"port_changed": port_changed}
        self._backoff(tr, policy, now)

    def _backoff(self, tr: Track, policy: Policy, now: float) -> None:
        tr.next_at = now + tr.backoff
        tr.backoff = min(policy.backoff_max, max(policy.backoff_initial, tr.backoff * 2))

    def _check_pending(self, comp: Component, tr: Track, policy: Policy, now: float) -> None:
        proc = tr.pending
        if comp.pid != tr.pending_pid:
            tr.pending = None  # someone else replaced it
            return
        if proc.poll() is not None:
            tr.pending = None
            self._failed_check(comp, tr, policy, f"restart exited (code {proc.returncode})", now)
            return
        info = ready_info(comp)
        if not restart_ready(comp, info):
            if now > tr.pending_deadline:
                tr.pending = None
                tr.answered = True  # so the next check treats it as hung, not as starting
                self._failed_check(comp, tr, policy, "restart not ready in time", now)
            return
        tr.pending = None
        tr.answered = True
        tr.misses = 0
        tr.healthy_since = now
        new_port = int(info.get("port") or 0) if info else 0
        with self._locked(wait=10.0) as s:
            if s is None or (s.get("components") or {}).get(comp.name, {}).get("pid") != comp.pid:
                return
            rec = s["components"][comp.name]
            if new_port and new_port != rec.get("port"):
                rec["port"] = new_port
                address = f"{connect_host(rec.get('host', ''))}:{new_port}"
                rec.setdefault("meta", {})["address"] = address
                reregister(self.group, self.service, s, comp, address, self.log)
            _update(s, comp.name, state="running")
            st.save(self.group, self.service, s)
        self.log(f"watchdog: {comp.name} is back (pid {comp.pid})")

    # ------------------------------------------------------------- helpers

    def _ready_timeout(self, s: dict[str, Any], comp: Component) -> float:
        if comp.role == "engine":
            return float(s.get("model_health_timeout") or 600.0)
        return max(30.0, float(s.get("launch_timeout") or s.get("setup_timeout") or 30.0))

    def _set(self, name: str, **fields: Any) -> None:
        with self._locked() as s:
            if s is None or name not in (s.get("components") or {}):
                return
            _update(s, name, **fields)
            st.save(self.group, self.service, s)

    def _locked(self, wait: float = 0.0):
        """The service state under its lock; None when busy or gone."""
        return locked_state(self.group, self.service, self.instance, wait)


def _kill_group(comp: Component) -> None:
    """SIGKILL the component's group (pid-identity checked) and wait until it is gone."""
    supervisor.terminate([[comp]], grace=0.0, force=True)


def _wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not supervisor.port_in_use(host, port):
            return True
        time.sleep(0.1)
    return False


def _update(s: dict[str, Any], name: str, **fields: Any) -> None:
    meta = s["components"][name].setdefault("meta", {})
    info = dict(meta.get("supervision") or {})
    info.setdefault("state", "running")
    info.setdefault("restarts", 0)
    info.update(fields)
    meta["supervision"] = info


# ----------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_cli.watchdog")
    p.add_argument("--group", required=True, choices=st.GROUPS)
    p.add_argument("--service", required=True)
    p.add_argument("--instance", default=None)
    a = p.parse_args(argv)
    st.check_name("service", a.service)
    stop = {"flag": False}

    def on_term(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    wd = Watchdog(a.group, a.service, instance=a.instance, log=log)
    log(f"watchdog: supervising {a.group} service '{a.service}'")
    guard: subprocess.Popen | None = None
    while not stop["flag"]:
        if guard is None or guard.poll() is not None:
            if guard is not None:
                log(f"watchdog: its guard exited (code {guard.returncode}); starting another")
            # Same process group as this watchdog: `stop` ends both together.
            guard = subprocess.Popen(
                guard_argv(a.group, a.service, a.instance), stdin=subprocess.DEVNULL
            )
        if not wd.tick():
            log("watchdog: service stopped; exiting")
            return 0
        deadline = time.monotonic() + wd.current_policy().check_interval
        while not stop["flag"] and time.monotonic() < deadline:
            time.sleep(0.05)
    log("watchdog: signal received; exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
