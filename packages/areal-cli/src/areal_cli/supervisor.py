"""Spawn components, wait until they are ready, terminate their process groups.

No typer here: the CLI, the tests and the benchmarks all start real processes
through this module. Every component runs in its own session (so its own
process group), with stdout and stderr appended to its log file.

A process is identified by (pid, start time); before signalling, the start
time is checked again so a reused pid never gets a signal meant for a dead
component.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.private_files import CHILD_UMASK, open_append


class LaunchError(Exception):
    """A component failed to start; carries its log path and last lines."""

    def __init__(self, component: str, reason: str, log: Path | None = None) -> None:
        self.component = component
        self.reason = reason
        self.log = log
        tail = log_tail(log, 15) if log else ""
        msg = f"{component} failed to start: {reason}"
        if log:
            msg += f"\n  log: {log}"
        if tail:
            msg += "\n  last lines:\n" + "\n".join("    " + ln for ln in tail.splitlines())
        super().__init__(msg)


@dataclass
class Component:
    """A started process, as recorded in service state."""

    name: str
    pid: int
    pgid: int
    start_time: int
    argv: list[str]
    log: str
    host: str = ""
    port: int = 0
    # Free-form facts about the component (role, model, rank, url, ...).
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Component:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def remote(self) -> bool:
        """Runs on a cluster node under a host actor (`meta.actor`): nothing local to signal
        (its pid is 0 here); whether it is alive is what the host last said (`meta.live`)."""
        return bool(self.meta.get("actor"))

    def alive(self) -> bool:
        if self.remote:
            return bool(self.meta.get("live"))
        return is_same_process(self.pid, self.start_time)


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (comm) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if rest[0] == b"Z":  # a zombie has exited; it only waits to be reaped
        return None
    return int(rest[19])


def is_same_process(pid: int, start_time: int) -> bool:
    return pid > 0 and proc_start_time(pid) == start_time


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


def log_tail(path: Path | str | None, lines: int = 20) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


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
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def read_ready_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def http_ok(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    import urllib.error  # lazily: keeps `areal --help` fast
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


def _signal_group(comp: Component, sig: int) -> bool:
    """Signal the component's group if it is still ours.

    Ours means: the leader is the recorded process (same start time), or the
    leader pid is gone entirely while members of its group remain (a pgid
    cannot be reused while any member is alive). A leader pid that now
    belongs to another process means the pid was reused: nothing is sent.
    """
    if comp.pid <= 0 or comp.pid == os.getpid() or comp.pgid == os.getpgid(0):
        return False
    if not comp.alive() and proc_start_time(comp.pgid) is not None:
        return False
    try:
        os.killpg(comp.pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_leader(comp: Component, sig: int) -> bool:
    """Signal the component's leader process if it is still ours (else its group, as
    `_signal_group` decides)."""
    if comp.pid <= 0 or comp.pid == os.getpid():
        return False
    if not comp.alive():
        return _signal_group(comp, sig)
    try:
        os.kill(comp.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_alive(comp: Component) -> bool:
    if comp.alive():
        return True
    if comp.pgid <= 0 or proc_start_time(comp.pgid) is not None:
        # The leader pid belongs to another process now: not our group.
        return False
    return _live_group_member(comp.pgid)


def _live_group_member(pgid: int) -> bool:
    """Whether a process of group `pgid` is alive (zombies waiting for a reaper are not)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2 :].split()
        # rest[0] = state, rest[2] = process group
        if len(rest) > 2 and int(rest[2]) == pgid and rest[0] != b"Z":
            return True
    return False


def processes_with_env(entry: str, *, cmdline: Callable[[bytes], bool] | None = None) -> list[int]:
    """Live processes (zombies aside, this one aside) whose environment holds `entry`
    (`NAME=value`) and, if given, whose command line `cmdline` accepts. Everything the CLI
    starts under an AREAL_HOME carries `AREAL_HOME=<home>`, so this finds what a service
    left behind whatever its process group."""
    marker = entry.encode()
    me = os.getpid()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            if cmdline is not None:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if not cmdline(f.read()):
                        continue
        except OSError:
            continue
        found.append(int(d))
    return found


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
                _signal_leader(comp, signal.SIGTERM)
            _wait_gone(tier, procs, tier_deadline, alive=Component.alive)
            for comp in tier:
                if group_alive(comp):
                    _signal_group(comp, signal.SIGTERM)
            _wait_gone(tier, procs, tier_deadline)
        for comp in tier:
            if group_alive(comp):
                _signal_group(comp, signal.SIGKILL)
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
