"""This machine's processes, read through psutil: start times, process groups, environments.

The bottom of the CLI's process layer: no areal module is imported here. A process is
identified by (pid, start time), so a pid the kernel gave to a new process is never taken
for the one recorded. The start time is in clock ticks since boot, the unit service state
has always recorded: unlike seconds since the epoch it does not move when the clock is
set, so a record stays valid for as long as the machine runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is gone or a zombie
    (a zombie has exited; it only waits to be reaped)."""
    if pid <= 0:
        return None
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            created = p.create_time()
        # psutil gives boot time + ticks since boot / CLK_TCK; taking the boot time off again
        # gives back the ticks, which no clock change moves.
        return round((created - psutil.boot_time()) * _CLOCK_TICKS)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_same_process(pid: int, started: int) -> bool:
    """Whether `pid` is still the process that started at `started` (clock ticks)."""
    return pid > 0 and start_time(pid) == started


def group_has_live_member(pgid: int) -> bool:
    """Whether a process of group `pgid` is alive (zombies waiting for a reaper are not)."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def processes_with_env(
    entry: str, *, cmdline: Callable[[list[str]], bool] | None = None
) -> list[int]:
    """Live processes (zombies aside, this one aside) whose environment holds `entry`
    (`NAME=value`) and, if given, whose argv `cmdline` accepts. Everything the CLI
    starts under an AREAL_HOME carries `AREAL_HOME=<home>`, so this finds what a service
    left behind whatever its process group."""
    name, _, value = entry.partition("=")
    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE or p.environ().get(name) != value:
                    continue
                if cmdline is not None and not cmdline(p.cmdline()):
                    continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found.append(p.pid)
    return found
