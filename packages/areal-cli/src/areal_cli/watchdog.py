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
  threshold; router, proxies and agent workers `GET /metrics` on the metrics
  port of their ready file, so a SIGSTOPped process is caught). A component is
  only probed for hangs after it has answered once since it (re)started.

A dead or hung component gets its process group killed and is respawned with
its recorded argv, environment (secrets re-read from the 0600 secrets file)
and working directory, **on its recorded port** (`--port 0` becomes the port
it had), so router registrations, the gateway's router address, a proxy's
worker address and client URLs stay valid. If that port is taken, a data
proxy gets a new one and is re-registered through the gateway admin API;
other roles retry later. Restarts back off exponentially (`backoff_initial`
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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.errors import CLIError
from areal_cli.guard import guard_argv
from areal_cli.launcher import connect_host, http_url
from areal_cli.supervisor import Component

# Environment variables that carry secrets: never recorded, re-read from the secrets file.
SECRET_ENV = {
    "AREAL_INTERNAL_TOKEN": "internal_token",
    "AREAL_ADMIN_API_KEY": "admin_api_key",
    "AREAL_PROXY_INF_ADMIN_API_KEY": "inf_admin_api_key",
    # The gateway's session-key signing secret: a restarted gateway must accept the keys
    # the one before it minted.
    "AREAL_SESSION_KEY_SECRET": "session_key_secret",
}
# Engines answer /health slowly under load (CPU engines especially): they need this many
# times `hung_after` failed probes before they count as hung.
ENGINE_HUNG_FACTOR = 4
PROBE_TIMEOUT = 2.0


@dataclass
class Policy:
    """How a service is supervised (`[supervision]` in the config, `--[no-]supervise`)."""

    enabled: bool = True
    max_restarts: int = 5
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    check_interval: float = 1.0
    hung_after: int = 3
    window: float = 600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Policy:
        d = d or {}
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def check(self) -> Policy:
        if self.max_restarts < 0:
            raise CLIError("[supervision] max_restarts must be 0 or more", code=2)
        for name in ("backoff_initial", "backoff_max", "check_interval", "window"):
            if getattr(self, name) <= 0:
                raise CLIError(f"[supervision] {name} must be positive", code=2)
        if self.backoff_max < self.backoff_initial:
            raise CLIError("[supervision] backoff_max must be >= backoff_initial", code=2)
        if self.hung_after < 1:
            raise CLIError("[supervision] hung_after must be at least 1", code=2)
        return self


def policy_from_config(cfg: Any, supervise_flag: bool | None) -> Policy:
    """`--supervise/--no-supervise` > `[supervision]` keys > built-in defaults."""
    p = Policy()
    for key in Policy.__dataclass_fields__:
        value = cfg.get("supervision", key)
        if value is not None:
            setattr(p, key, type(getattr(p, key))(value))
    if supervise_flag is not None:
        p.enabled = supervise_flag
    return p.check()


def sup_info(comp: Component) -> dict[str, Any]:
    info = comp.meta.get("supervision")
    return info if isinstance(info, dict) else {}


def sup_state(comp: Component) -> str:
    return str(sup_info(comp).get("state") or "")


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
        if s is None or s.get("phase") == "stopped":
            return True
        return self.instance is not None and s.get("instance") != self.instance

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
            self.follow_moves()
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
        limit = policy.hung_after * (ENGINE_HUNG_FACTOR if _role(comp) == "engine" else 1)
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
            if cur.port:
                host = cur.host or "127.0.0.1"
                if supervisor.port_in_use(host, cur.port) and not _wait_port(host, cur.port, 3.0):
                    if _role(cur) == "proxy":
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
            ready = _ready_path(argv)
            if ready is not None:
                with contextlib.suppress(FileNotFoundError):
                    ready.unlink()
            env = self._env(cur)
            cwd = cur.meta.get("cwd") or None
            if cwd and not os.path.isdir(cwd):
                cwd = None
            try:
                proc, new = supervisor.spawn(
                    cur.name,
                    argv,
                    Path(cur.log),
                    env=env,
                    cwd=cwd,
                    host=cur.host,
                    port=0 if port_changed else cur.port,
                    meta=dict(cur.meta),
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
        info = _ready_info(comp)
        if not self._is_ready(comp, info):
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
                self._reregister(s, comp, address)
            _update(s, comp.name, state="running")
            st.save(self.group, self.service, s)
        self.log(f"watchdog: {comp.name} is back (pid {comp.pid})")

    def _is_ready(self, comp: Component, info: dict[str, Any] | None) -> bool:
        role = _role(comp)
        if role == "engine":
            url = comp.meta.get("url", "")
            return bool(url) and supervisor.http_ok(url + "/health", timeout=PROBE_TIMEOUT)
        if not info or info.get("pid") != comp.pid or not info.get("port"):
            return False
        if role == "gateway":
            from areal_cli.http import gateway_healthy

            url = http_url(comp.host, int(info["port"]))
            return gateway_healthy(url, comp.pid, timeout=PROBE_TIMEOUT)
        return True

    def follow_moves(self) -> None:
        """On a cluster: a proxy whose host Ray placed again (its node was lost) answers at a
        new address; re-register it there and record where it is now."""
        from areal_cli.lifecycle import components

        try:
            s = st.load(self.group, self.service)
        except CLIError:
            return
        if s is None or self.gone(s):
            return
        comps = components(s)  # asks the hosts (in place on `s`)
        moved = [
            c
            for c in comps.values()
            if c.remote
            and c.meta.get("live")
            and c.meta.get("role") == "proxy"
            and c.meta.get("live_address")
            and c.meta["live_address"] != c.meta.get("address")
        ]
        if not moved:
            return
        with self._locked(wait=5.0) as cur:
            if cur is None:
                return
            for c in moved:
                address = c.meta["live_address"]
                self.log(f"watchdog: {c.name} now runs on {c.meta.get('node')} at {address}")
                self._reregister(cur, c, address)
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
            st.save(self.group, self.service, cur)

    def _reregister(self, s: dict[str, Any], comp: Component, address: str) -> None:
        """A proxy that came back on a new port: tell the router through the gateway."""
        from areal_cli.http import call

        url = (s.get("gateway") or {}).get("url", "")
        key = st.load_secrets(self.group, self.service).get("admin_api_key", "")
        pid = comp.meta.get("proxy_id") or comp.name
        try:
            if self.group == "agent":
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
            self.log(f"watchdog: re-registering {comp.name} at {address} failed: {e}")

    # ------------------------------------------------------------- helpers

    def _env(self, comp: Component) -> dict[str, str]:
        return component_env(self.group, self.service, comp)

    def _ready_timeout(self, s: dict[str, Any], comp: Component) -> float:
        if _role(comp) == "engine":
            return float(s.get("model_health_timeout") or 600.0)
        return max(30.0, float(s.get("launch_timeout") or s.get("setup_timeout") or 30.0))

    def _set(self, name: str, **fields: Any) -> None:
        with self._locked() as s:
            if s is None or name not in (s.get("components") or {}):
                return
            _update(s, name, **fields)
            st.save(self.group, self.service, s)

    @contextlib.contextmanager
    def _locked(self, wait: float = 0.0):
        """The service state under its lock; None when busy or gone."""
        lock = st.Lock(self.group, self.service)
        try:
            lock.acquire(wait)
        except CLIError:
            yield None
            return
        try:
            s = st.load(self.group, self.service)
            yield None if self.gone(s) else s
        finally:
            lock.release()


def component_env(group: str, service: str, comp: Component) -> dict[str, str]:
    """The environment to respawn `comp` with: recorded values, secrets re-read from disk."""
    env = {str(k): str(v) for k, v in (comp.meta.get("env") or {}).items()}
    names = comp.meta.get("secret_env")
    if names is None:  # recorded before env was: every component gets the token
        names = ["AREAL_INTERNAL_TOKEN"] + (
            ["AREAL_ADMIN_API_KEY"] if _role(comp) == "gateway" else []
        )
    secrets = st.load_secrets(group, service)
    for n in names:
        if (v := secrets.get(SECRET_ENV.get(n, ""))) is not None:
            env[n] = v
    return env


# ----------------------------------------------------------------- probes


def _role(comp: Component) -> str:
    return str(comp.meta.get("role", ""))


def _ready_path(argv: list[str]) -> Path | None:
    for i, a in enumerate(argv[:-1]):
        if a == "--ready-file":
            return Path(argv[i + 1])
    return None


def _ready_info(comp: Component) -> dict[str, Any] | None:
    path = _ready_path(comp.argv)
    return supervisor.read_ready_file(path) if path else None


def default_probe(comp: Component, s: dict[str, Any]) -> bool | None:
    """True: answers; False: does not; None: nothing to ask (counts as fine)."""
    role = _role(comp)
    if role == "gateway":
        from areal_cli.http import gateway_healthy

        url = (s.get("gateway") or {}).get("url") or http_url(comp.host, comp.port)
        return gateway_healthy(url, comp.pid, timeout=PROBE_TIMEOUT)
    if role == "engine":
        url = comp.meta.get("url", "")
        return supervisor.http_ok(url + "/health", timeout=PROBE_TIMEOUT) if url else None
    info = _ready_info(comp)
    if not info or info.get("pid") != comp.pid:
        return None
    mport = int(info.get("metrics_port") or 0)
    if mport <= 0:
        return None
    host = connect_host(str(info.get("host") or comp.host))
    return supervisor.http_ok(http_url(host, mport) + "/metrics", PROBE_TIMEOUT)


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
