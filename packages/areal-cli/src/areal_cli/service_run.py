"""`areal <group> run`, shared by `areal inf` and `areal agent`: under the service lock
clear what an earlier run left, save the secrets and start the components (launcher.py);
then return (`--detach`, with the watchdog as a component) or watch the service in the
foreground (the watchdog in this process, or without supervision a teardown on the first
death) until Ctrl-C, SIGTERM or `stop`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.components import Component
from areal_cli.errors import CLIError
from areal_cli.launcher import (
    SESSION_KEY_SECRET_ENV,
    Interrupted,
    Launcher,
    fail_launch,
    progress,
    start_watchdog,
    stop_signals,
)
from areal_cli.readdress import follow_moves
from areal_cli.reconcile import (
    components,
    service_gone,
    service_status,
    terminate_components,
)
from areal_cli.watchdog import Watchdog


def run_service(
    group: str,
    service: str,
    *,
    force: bool,
    host: str,
    port: int,
    port_setting: str,
    admin_api_key: str,
    extra_secrets: dict[str, str] | None,
    new_state: Callable[[], dict[str, Any]],
    start: Callable[[Launcher], None],
    detach: bool,
    supervise: bool,
    summary: Callable[[Launcher], None],
) -> int:
    """`areal <group> run` around its group's `start`: under the service lock clear the
    old state, save the secrets and `start` the components; then mark the service
    running, print the summary and return (`detach`) or watch it in the foreground.

    A launch that fails or is interrupted stops everything it started and leaves no
    state; its progress line says "run failed". `new_state` is called once
    the old state is gone, so `created_at` is now.
    """
    lock = st.Lock(group, service)
    lock.acquire()
    try:
        clear_existing(group, service, force)
        if port and supervisor.port_in_use(host, port):
            raise CLIError(
                f"port {port} on {host} is already in use: choose another --port "
                f"(or {port_setting})"
            )
        token = secrets.token_urlsafe(32)
        # Signs the gateway's session keys; kept with the other secrets so the watchdog gives
        # a restarted gateway the same one (its sessions' keys keep working). Per run, like
        # the sessions themselves.
        session_key_secret = secrets.token_urlsafe(32)
        secret_doc = {
            "admin_api_key": admin_api_key,
            "internal_token": token,
            "session_key_secret": session_key_secret,
        }
        st.save_secrets(group, service, {**secret_doc, **(extra_secrets or {})})
        launcher = Launcher(
            group,
            service,
            new_state(),
            {"AREAL_INTERNAL_TOKEN": token},
            gateway_env={SESSION_KEY_SECRET_ENV: session_key_secret},
        )
        try:
            with stop_signals():
                start(launcher)
                launcher.state["phase"] = "running"
                launcher.save()
                if detach and supervise:
                    start_watchdog(launcher)
        except BaseException as e:
            fail_launch(launcher, e, "run", lambda: st.remove(group, service))
    finally:
        lock.release()
    summary(launcher)
    if detach:
        return 0
    return monitor_foreground(
        group, service, launcher.state["instance"], launcher.procs, supervise=supervise
    )


def clear_existing(group: str, service: str, force: bool) -> None:
    """Refuse over recorded state, or with --force stop what it records (pid-checked) first."""
    old = st.load(group, service)
    if old is None:
        return
    status = service_status(old)
    if not force:
        if status in ("running", "degraded", "starting"):
            url = (old.get("gateway") or {}).get("url") or "-"
            raise CLIError(
                f"{group} service '{service}' is already {status} (gateway {url}); "
                f"stop it with `areal {group} stop --service {service}` or replace it with --force"
            )
        raise CLIError(
            f"{group} service '{service}' has {status} state; clean it with "
            f"`areal {group} stop --service {service}` or start over it with --force"
        )
    comps = list(components(old).values())
    alive = [c for c in comps if supervisor.group_alive(c)]
    if alive:
        progress(f"--force: stopping {len(alive)} recorded component(s) of '{service}'")
    survivors = terminate_components(comps, grace=5.0)
    if survivors:
        raise CLIError(f"--force: could not stop {', '.join(survivors)}")
    st.remove(group, service)


def monitor_foreground(
    group: str, service: str, instance: str, procs: dict[int, Any], supervise: bool = False
) -> int:
    """Watch a foreground service until Ctrl-C / SIGTERM (tear down, 0).

    With `supervise` the in-process watchdog restarts dead or hung components
    (areal_cli.watchdog); without it a death tears the whole service down (exit 1).
    Re-reads the state each round, so components added by `register` are watched
    and torn down too, and one removed by `deregister` is not reported. When the
    state disappears (`areal <group> stop` from elsewhere) it returns 0.
    """

    def gone(s: dict[str, Any] | None) -> bool:
        return service_gone(s, instance)

    try:
        with stop_signals():
            if supervise:
                wd = Watchdog(group, service, instance=instance, procs=procs, log=progress)
                while wd.tick():
                    time.sleep(wd.current_policy().check_interval)
                progress(f"{group} service '{service}' was stopped")
                return 0
            next_follow = 0.0
            while True:
                time.sleep(0.3)
                for p in procs.values():
                    p.poll()  # reap our children so a dead one is seen as dead
                s = st.load(group, service)
                if gone(s):
                    progress(f"{group} service '{service}' was stopped")
                    return 0
                assert s is not None
                if s.get("scheduler") == "ray" and time.monotonic() >= next_follow:
                    follow_moves(group, service, instance, log=progress)
                    next_follow = time.monotonic() + 2.0
                # Components on a cluster are kept alive by their hosts; not torn down here.
                here = [Component.from_dict(d) for d in (s.get("components") or {}).values()]
                if all(c.alive() for c in here if not c.remote):
                    continue
                try:
                    lock = st.Lock(group, service)
                    lock.acquire()
                except CLIError:
                    continue  # someone (register / deregister / stop) is changing it
                with lock:
                    s = st.load(group, service)
                    if gone(s):
                        continue
                    assert s is not None
                    comps = components(s)
                    dead = [c for c in comps.values() if not c.remote and not c.alive()]
                    if not dead:
                        continue
                    lines = []
                    for c in dead:
                        p = procs.get(c.pid)
                        code = f" (exit code {p.returncode})" if p is not None else ""
                        lines.append(f"  {c.name} died{code}; log: {c.log}")
                        tail = supervisor.log_tail(c.log, 10)
                        lines += ["    " + ln for ln in tail.splitlines()]
                    progress("\n".join(lines))
                    progress(f"tearing down {group} service '{service}'")
                    terminate_components(list(comps.values()), grace=5.0, procs=procs)
                    st.remove(group, service)
                names = ", ".join(c.name for c in dead)
                raise CLIError(f"{names} of {group} service '{service}' died; service torn down")
    except (KeyboardInterrupt, Interrupted):
        progress(f"\nstopping {group} service '{service}' ...")
        with st.locked(group, service, wait=60):
            s = st.load(group, service)
            if not gone(s):
                assert s is not None
                terminate_components(list(components(s).values()), grace=10.0, procs=procs)
                st.remove(group, service)
        progress(f"{group} service '{service}' stopped")
        return 0
