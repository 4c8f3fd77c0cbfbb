"""Process supervision with real child processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from areal_cli import components, supervisor


def _sleeper(tmp_path, name="sleeper", code="import time; time.sleep(60)"):
    return supervisor.spawn(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_spawn_records_identity_and_own_group(tmp_path):
    proc, comp = _sleeper(tmp_path)
    try:
        assert comp.pid == proc.pid == comp.pgid
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        assert comp.alive()
        assert supervisor.proc_start_time(proc.pid) == comp.start_time
    finally:
        supervisor.terminate([[comp]], grace=2, procs={proc.pid: proc})
    assert not comp.alive()
    assert not supervisor.group_alive(comp)


def test_pid_reuse_is_not_signalled(tmp_path):
    proc, comp = _sleeper(tmp_path)
    forged = supervisor.Component.from_dict({**comp.to_dict(), "start_time": comp.start_time + 1})
    assert not forged.alive()
    supervisor.terminate([[forged]], grace=0.2)
    assert proc.poll() is None, "a process whose start time differs must not be signalled"
    supervisor.terminate([[comp]], grace=2, procs={proc.pid: proc})
    assert proc.poll() is not None


def test_terminate_kills_after_grace_and_whole_group(tmp_path):
    # The leader ignores SIGTERM and has a child: both must go after the grace.
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    proc, comp = _sleeper(tmp_path, "stubborn", code)
    time.sleep(0.5)
    t0 = time.monotonic()
    supervisor.terminate([[comp]], grace=0.5, procs={proc.pid: proc})
    assert time.monotonic() - t0 < 4
    assert not supervisor.group_alive(comp)


def test_sigterm_goes_to_the_leader_first_then_to_what_it_left(tmp_path):
    # The leader stops its first child itself (as an engine does) and leaves a second one
    # behind. Only the leader hears SIGTERM from us at first; the one left behind gets it as
    # soon as the leader is gone, well before the grace period ends.
    marks = tmp_path / "marks"
    child = (
        "import signal, sys, time\n"
        "def term(*_):\n"
        f"    open({str(marks)!r}, 'a').write(sys.argv[1] + ' TERM\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))\n"
        "open(sys.argv[2], 'w').close()\n"
        "time.sleep(60)\n"
    )
    leader = (
        "import signal, subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {child!r}, n, {str(tmp_path)!r} + '/up-' + n])"
        " for n in ('managed', 'left')]\n"
        "def term(*_):\n"
        "    time.sleep(0.3)  # drains first, as an engine does\n"
        "    kids[0].send_signal(signal.SIGUSR1); kids[0].wait(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "time.sleep(60)\n"
    )
    proc, comp = _sleeper(tmp_path, "engine-like", leader)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"up-{n}").exists() for n in ("managed", "left")):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.05)
    t0 = time.monotonic()
    supervisor.terminate([[comp]], grace=10, procs={proc.pid: proc})
    assert time.monotonic() - t0 < 5
    assert not supervisor.group_alive(comp)
    assert marks.read_text().split("\n")[:-1] == ["left TERM"]


def test_tiers_share_one_grace_period(tmp_path):
    comps, procs = [], {}
    for i in range(4):
        p, c = _sleeper(
            tmp_path,
            f"s{i}",
            "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        )
        comps.append(c)
        procs[p.pid] = p
    time.sleep(0.3)
    t0 = time.monotonic()
    supervisor.terminate([comps[:2], comps[2:]], grace=1.0, procs=procs)
    took = time.monotonic() - t0
    assert not any(supervisor.group_alive(c) for c in comps)
    assert took < 3.0, f"stop took {took:.1f}s: groups must be stopped in parallel"


def test_wait_ready_fails_fast_when_process_exits(tmp_path):
    proc, comp = _sleeper(tmp_path, "crasher", "import sys; print('boom: bad flag'); sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(supervisor.LaunchError) as info:
        supervisor.wait_ready(proc, comp, lambda: False, timeout=30)
    assert time.monotonic() - t0 < 5
    assert "exited (code 3)" in str(info.value)
    assert "boom: bad flag" in str(info.value)
    assert str(tmp_path / "crasher.log") in str(info.value)


def test_wait_ready_times_out(tmp_path):
    proc, comp = _sleeper(tmp_path)
    try:
        with pytest.raises(supervisor.LaunchError, match=r"not ready after 0\.3s"):
            supervisor.wait_ready(proc, comp, lambda: False, timeout=0.3)
    finally:
        supervisor.terminate([[comp]], grace=1, procs={proc.pid: proc})


def test_missing_executable_is_a_launch_error(tmp_path):
    with pytest.raises(supervisor.LaunchError, match="executable not found"):
        supervisor.spawn("ghost", ["/nonexistent/areal-ghost"], tmp_path / "ghost.log")


def test_port_helpers():
    port = supervisor.free_port()
    assert not supervisor.port_in_use("127.0.0.1", port)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert supervisor.port_in_use("127.0.0.1", port)


def test_signal_own_pid_is_refused():
    me = supervisor.Component(
        "me", os.getpid(), os.getpgid(0), supervisor.proc_start_time(os.getpid()) or 0, [], ""
    )
    assert components.signal_group(me, signal.SIGTERM) is False


def test_processes_with_env_finds_what_carries_the_marker(tmp_path):
    entry = f"AREAL_HOME={tmp_path}"
    proc, comp = supervisor.spawn(
        "marked",
        [sys.executable, "-c", "import time; time.sleep(60)", "marked-sleeper"],
        tmp_path / "marked.log",
        env={**os.environ, "AREAL_HOME": str(tmp_path)},
    )
    other, other_comp = _sleeper(tmp_path, "unmarked")
    try:
        assert supervisor.processes_with_env(entry) == [proc.pid]
        assert supervisor.processes_with_env(entry, cmdline=lambda a: "marked-sleeper" in a) == [
            proc.pid
        ]
        assert supervisor.processes_with_env(entry, cmdline=lambda a: "nope" in a) == []
    finally:
        supervisor.terminate(
            [[comp, other_comp]], grace=2, procs={proc.pid: proc, other.pid: other}
        )
    assert supervisor.processes_with_env(entry) == []
