"""procs.py against real processes: the start time is the kernel's, zombies are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from areal_cli import components, procs


def _kernel_start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot): what service state recorded
    before psutil, so records written by an earlier CLI must still match."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def _child(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", *argv], start_new_session=True, stdin=subprocess.DEVNULL
    )


def test_start_time_is_the_kernels_clock_ticks():
    child = _child("import time; time.sleep(60)")
    try:
        for pid in (os.getpid(), child.pid, 1):
            assert procs.start_time(pid) == _kernel_start_time(pid)
        assert procs.is_same_process(child.pid, _kernel_start_time(child.pid))
        assert not procs.is_same_process(child.pid, _kernel_start_time(child.pid) + 1)
    finally:
        child.kill()
        child.wait()
    assert procs.start_time(child.pid) is None
    assert procs.start_time(0) is None and procs.start_time(-1) is None


def test_a_zombie_is_gone_and_its_group_has_no_live_member():
    child = _child("import time; time.sleep(60)")
    started = _kernel_start_time(child.pid)
    comp = components.Component("z", child.pid, child.pid, started, [], "")
    assert procs.group_has_live_member(child.pid) and components.group_alive(comp)
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    # Not reaped: the pid stays, as a zombie, until wait().
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert procs.start_time(child.pid) is None
        assert not comp.alive()
        assert not procs.group_has_live_member(child.pid)
        assert not components.group_alive(comp)
    finally:
        child.wait()


def test_a_group_lives_on_in_a_member_after_its_leader():
    # The leader starts a sleeper in its own group and exits; the sleeper keeps the group.
    leader = _child(
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    )
    leader.wait()
    comp = components.Component("g", leader.pid, leader.pid, 1, [], "")
    try:
        assert not comp.alive()
        assert procs.group_has_live_member(leader.pid)
        assert components.group_alive(comp)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while procs.group_has_live_member(leader.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
