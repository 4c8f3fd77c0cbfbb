"""The watchdog's keeper: a watchdog that dies is started again.

The watchdog restarts every other component of a detached service; nothing
restarted the watchdog, so after a `kill -9` of it the next component to die
stayed dead. The guard is a small process the watchdog starts in its own
process group (so `stop`, which ends that group, ends both) and restarts when
it dies. When the watchdog's recorded process is gone while the service is
running, the guard spawns it again from its recorded argv in a new group,
records the restart (`meta.supervision`, as for any component, so `status`
shows it), and exits: the new watchdog starts a guard of its own.

Under the service lock, never waited for: `stop` holds the lock while it ends
the watchdog, so a guard cannot restart what is being stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.components import Component
from areal_cli.errors import CLIError
from areal_cli.reconcile import service_gone

CHECK_INTERVAL = 0.5


def guard_argv(group: str, service: str, instance: str | None) -> list[str]:
    argv = [sys.executable, "-m", "areal_cli.guard", "--group", group, "--service", service]
    return argv + (["--instance", instance] if instance else [])


def _watchdog(s: dict[str, Any]) -> Component | None:
    for d in (s.get("components") or {}).values():
        if (d.get("meta") or {}).get("role") == "watchdog":
            return Component.from_dict(d)
    return None


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def restart_watchdog(group: str, service: str, instance: str | None, dead_pid: int) -> bool:
    """Respawn the recorded watchdog if it is still the dead `dead_pid`; True once done."""
    lock = st.Lock(group, service)
    try:
        lock.acquire(0.0)
    except CLIError:
        return False  # busy (a stop, a register, a watchdog tick): look again later
    try:
        s = st.load(group, service)
        if service_gone(s, instance) or s is None or s.get("phase") != "running":
            return True
        cur = _watchdog(s)
        if cur is None or cur.pid != dead_pid or cur.alive():
            return True  # replaced meanwhile
        _proc, new = supervisor.respawn(group, service, cur)
        info = dict(cur.meta.get("supervision") or {})
        new.meta["restarted_at"] = time.time()
        new.meta["supervision"] = {
            **info,
            "state": "running",
            "restarts": int(info.get("restarts") or 0) + 1,
            "last_failure": {"reason": f"watchdog process {dead_pid} died", "at": time.time()},
        }
        s["components"][cur.name] = new.to_dict()
        st.save(group, service, s)
        _log(f"guard: watchdog {dead_pid} died; started it again (pid {new.pid})")
        return True
    except supervisor.LaunchError as e:
        _log(f"guard: could not restart the watchdog: {e.reason}")
        return False
    finally:
        lock.release()


def run(group: str, service: str, instance: str | None, parent: int) -> int:
    """Watch the watchdog that started us (`parent`) until the service or it is replaced."""
    while True:
        time.sleep(CHECK_INTERVAL)
        try:
            s = st.load(group, service)
        except CLIError:
            continue  # a write in progress elsewhere: read again next time
        if service_gone(s, instance) or s is None:
            return 0
        wd = _watchdog(s)
        if wd is None:
            return 0
        if wd.alive():
            if wd.pid != parent:
                return 0  # a newer watchdog has a guard of its own
            continue
        if restart_watchdog(group, service, instance, wd.pid):
            return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_cli.guard")
    p.add_argument("--group", required=True, choices=st.GROUPS)
    p.add_argument("--service", required=True)
    p.add_argument("--instance", default=None)
    a = p.parse_args(argv)
    st.check_name("service", a.service)
    with contextlib.suppress(KeyboardInterrupt):
        return run(a.group, a.service, a.instance, os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
