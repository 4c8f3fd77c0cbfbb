"""The Component record (a started process as service state records it) and what is read
or sent to one: alive, its process group, pid-checked signals, its supervision record, its
address.

Above procs.py, below everything else of the process layer: it imports no other
module of it. Every component runs in its own session, so its own process group (pgid =
the leader's pid). Before a signal the leader's start time is checked again, so a reused
pid never gets a signal meant for a dead component.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from areal_cli import procs


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

    @property
    def role(self) -> str:
        return str(self.meta.get("role", ""))

    def alive(self) -> bool:
        if self.remote:
            return bool(self.meta.get("live"))
        return procs.is_same_process(self.pid, self.start_time)


# ----------------------------------------------------------------- process groups


def group_alive(comp: Component) -> bool:
    """The leader is alive, or (leader gone) a live member of its group remains."""
    if comp.alive():
        return True
    if comp.pgid <= 0 or procs.start_time(comp.pgid) is not None:
        # The leader pid belongs to another process now: not our group.
        return False
    return procs.group_has_live_member(comp.pgid)


def signal_group(comp: Component, sig: int) -> bool:
    """Signal the component's group if it is still ours.

    Ours means: the leader is the recorded process (same start time), or the
    leader pid is gone entirely while members of its group remain (a pgid
    cannot be reused while any member is alive). A leader pid that now
    belongs to another process means the pid was reused: nothing is sent.
    """
    if comp.pid <= 0 or comp.pid == os.getpid() or comp.pgid == os.getpgid(0):
        return False
    if not comp.alive() and procs.start_time(comp.pgid) is not None:
        return False
    try:
        os.killpg(comp.pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_leader(comp: Component, sig: int) -> bool:
    """Signal the component's leader process if it is still ours (else its group, as
    `signal_group` decides)."""
    if comp.pid <= 0 or comp.pid == os.getpid():
        return False
    if not comp.alive():
        return signal_group(comp, sig)
    try:
        os.kill(comp.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ----------------------------------------------------------------- supervision record


def sup_info(comp: Component) -> dict[str, Any]:
    """`meta.supervision` as the watchdog wrote it: {state, restarts, last_failure}."""
    info = comp.meta.get("supervision")
    return info if isinstance(info, dict) else {}


def sup_state(comp: Component) -> str:
    """running | restarting | failed, or "" when the watchdog never wrote one."""
    return str(sup_info(comp).get("state") or "")


# ----------------------------------------------------------------- addresses


def connect_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_url(host: str, port: int) -> str:
    h = connect_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"
