"""Spawn components, wait until they are ready, terminate their process groups in tiers.

No typer here: the CLI, the tests and the benchmarks all start real processes
through this module. Every component runs in its own session (so its own
process group), with stdout and stderr appended to its log file.

In the process layer it sits on components.py (the record, pid-checked signals) and
procs.py (psutil); launcher, watchdog and guard sit on it. It also names what those
modules and their callers use from below (`Component`, `group_alive`, ...), so
`supervisor.X` keeps working for them.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from areal_cli import state as st
from areal_cli.components import Component as Component
from areal_cli.components import LaunchError as LaunchError
from areal_cli.components import group_alive as group_alive
from areal_cli.components import log_tail as log_tail
from areal_cli.components import signal_group, signal_leader
from areal_cli.private_files import CHILD_UMASK, open_append
from areal_cli.procs import is_same_process as is_same_process
from areal_cli.procs import processes_with_env as processes_with_env
from areal_cli.procs import start_time as proc_start_time

# Environment variables that carry secrets: never recorded in state (their names are), read
# again from the 0600 secrets file when a component is started again.
SECRET_ENV = {
    "AREAL_INTERNAL_TOKEN": "internal_token",
    "AREAL_ADMIN_API_KEY": "admin_api_key",
    "AREAL_PROXY_INF_ADMIN_API_KEY": "inf_admin_api_key",
    # The gateway's session-key signing secret: a restarted gateway must accept the keys
    # the one before it minted.
    "AREAL_SESSION_KEY_SECRET": "session_key_secret",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def spawn(
    name: str,
    argv: list[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    host: str = "",
    port: int = 0,
    meta: dict[str, Any] | None = None,
    die_with_parent: bool = False,
) -> tuple[subprocess.Popen, Component]:
    """Start `argv` in a new process group with output appended to `log`.

    `die_with_parent`: the child gets SIGKILL when the thread that started it ends
    (PR_SET_PDEATHSIG), for a parent that may itself be killed without a chance to stop it
    (a cluster node's host actor)."""
    full_env = {**os.environ, **(env or {})}
    with open_append(log) as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}\n".encode())
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
                umask=CHILD_UMASK,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        except FileNotFoundError as e:
            raise LaunchError(name, f"executable not found: {argv[0]}") from e
        except PermissionError as e:
            raise LaunchError(name, f"executable not runnable: {argv[0]} ({e})") from e
    start = proc_start_time(proc.pid) or 0
    comp = Component(
        name, proc.pid, proc.pid, start, list(argv), str(log), host, port, dict(meta or {})
    )
    return proc, comp


def _die_with_parent() -> None:
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def read_ready_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def http_ok(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    # urllib (with http.client and ssl) on first use: `areal inf ps` and `stop` never need it.
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(
    proc: subprocess.Popen | None,
    comp: Component,
    check: Callable[[], bool],
    timeout: float,
    *,
    interval: float = 0.05,
    max_interval: float = 0.5,
) -> None:
    """Poll `check` until it passes; fail fast when the process exits.

    `check` runs only while our process is alive, and the process must still
    be alive after it passes, so a port served by someone else is not
    mistaken for our component.
    """
    deadline = time.monotonic() + timeout
    while True:
        if not _alive(proc, comp):
            code = proc.poll() if proc is not None else None
            raise LaunchError(comp.name, f"process exited (code {code})", Path(comp.log))
        if check() and _alive(proc, comp):
            return
        if time.monotonic() >= deadline:
            raise LaunchError(comp.name, f"not ready after {timeout:g}s", Path(comp.log))
        time.sleep(interval)
        interval = min(max_interval, interval * 1.5)


def _alive(proc: subprocess.Popen | None, comp: Component) -> bool:
    if proc is not None:
        return proc.poll() is None
    return comp.alive()


def component_env(group: str, service: str, comp: Component) -> dict[str, str]:
    """The environment to start `comp` again with: recorded values, secrets re-read."""
    env = {str(k): str(v) for k, v in (comp.meta.get("env") or {}).items()}
    names = comp.meta.get("secret_env")
    if names is None:  # recorded before env was: every component gets the token
        names = ["AREAL_INTERNAL_TOKEN"] + (
            ["AREAL_ADMIN_API_KEY"] if comp.role == "gateway" else []
        )
    secrets = st.load_secrets(group, service)
    for n in names:
        if (v := secrets.get(SECRET_ENV.get(n, ""))) is not None:
            env[n] = v
    return env


def respawn(
    group: str, service: str, comp: Component, argv: list[str] | None = None, port: int = -1
) -> tuple[subprocess.Popen, Component]:
    """Start a recorded component again: its argv (or `argv`), its recorded environment with
    the secrets re-read, its working directory if that still exists, its meta; `port` (when
    not -1) replaces the recorded port. The new record has the new pid and start time."""
    cwd = comp.meta.get("cwd") or None
    return spawn(
        comp.name,
        list(comp.argv if argv is None else argv),
        Path(comp.log),
        env=component_env(group, service, comp),
        cwd=cwd if cwd and os.path.isdir(cwd) else None,
        host=comp.host,
        port=comp.port if port == -1 else port,
        meta=dict(comp.meta),
    )


def terminate(
    groups: Iterable[Iterable[Component]],
    *,
    grace: float = 10.0,
    force: bool = False,
    procs: dict[int, subprocess.Popen] | None = None,
) -> None:
    """Stop components tier by tier; within a tier, all at once.

    Each tier gets SIGTERM, then SIGKILL for whatever remains after `grace`
    seconds (at once with `force`). Later tiers wait for earlier ones, so a
    proxy stops before its engine, and the router last.
    """
    procs = procs or {}
    tiers = [list(t) for t in groups]
    deadline = time.monotonic() + grace
    for tier in tiers:
        # Tiers share one grace period, but a late tier still gets a moment
        # to exit cleanly before SIGKILL.
        tier_deadline = max(deadline, time.monotonic() + min(grace, 1.0))
        if not force:
            # The leader first: a program that manages its children (an engine) stops them
            # itself, where SIGTERM to the whole group reads to it as a child crashing
            # (SGLang then logs crashes and waits 5 s for diagnostics). What a leader
            # leaves behind gets SIGTERM as soon as the leader is gone.
            for comp in tier:
                signal_leader(comp, signal.SIGTERM)
            _wait_gone(tier, procs, tier_deadline, alive=Component.alive)
            for comp in tier:
                if group_alive(comp):
                    signal_group(comp, signal.SIGTERM)
            _wait_gone(tier, procs, tier_deadline)
        for comp in tier:
            if group_alive(comp):
                signal_group(comp, signal.SIGKILL)
        _wait_gone(tier, procs, time.monotonic() + 5)


def _wait_gone(
    tier: list[Component],
    procs: dict[int, subprocess.Popen],
    deadline: float,
    alive: Callable[[Component], bool] = group_alive,
) -> None:
    interval = 0.01
    while True:
        for comp in tier:
            if (p := procs.get(comp.pid)) is not None:
                p.poll()  # reap our own child so it stops being a zombie
        if not any(alive(c) for c in tier) or time.monotonic() >= deadline:
            return
        time.sleep(interval)
        interval = min(0.1, interval * 2)
