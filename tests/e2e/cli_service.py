"""A real `areal inf` service started by the CLI as a user starts it, for e2e suites that need
the CLI's whole service (its proxies' `--router-addr`, its engines' process groups).

`Areal` runs `areal ...` with a private AREAL_HOME and this venv's bin on PATH;
`cli_service` starts `areal inf run --detach` and, on exit, stops it and checks that every
process group it started is gone (anything left is killed, by pid, and fails the test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testpaths import PARROT, ROOT

from areal_cli import engines, supervisor
from areal_cli.errors import CLIError


def sglang_missing() -> bool:
    try:
        engines.resolve_python("sglang")
    except CLIError:
        return True
    return False


class Areal:
    """`areal ...` as a user runs it, with a private AREAL_HOME and this venv's bin on PATH."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if k != "AREAL_ADMIN_API_KEY"}
        self.env["AREAL_HOME"] = str(home)
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU engine's default arguments

    def __call__(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "areal_cli.main", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=ROOT,
        )

    def status(self) -> dict[str, Any]:
        r = self("inf", "status", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def components(self) -> dict[str, Any]:
        """The recorded components (from the state file: readable while the CLI holds it)."""
        try:
            path = self.home / "inf" / "services" / "default.json"
            return json.loads(path.read_text())["components"]
        except (OSError, ValueError, KeyError):
            return {}

    def processes(self) -> list[int]:
        return supervisor.processes_with_env(f"AREAL_HOME={self.home}")


def group_alive(pgid: int) -> bool:
    """A live (not zombie) process is in the group."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                rest = Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] != b"Z":
                return True
    return False


@contextmanager
def cli_service(home: Path, *run_args: str) -> Iterator[tuple[Areal, str]]:
    """`areal inf run <run_args> --port 0 --detach`; yields (areal, gateway url)."""
    a = Areal(home)
    r = a("inf", "run", *run_args, "--port", "0", "--detach")
    pgids: set[int] = set()
    try:
        assert r.returncode == 0, r.stderr
        yield a, a.status()["gateway"]["url"]
    finally:
        pgids |= {c["pgid"] for c in a.components().values() if c.get("pgid")}
        stop = a("inf", "stop", "--grace", "10", timeout=120)
        deadline = time.monotonic() + 20
        while (left := [g for g in pgids if group_alive(g)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in a.processes():
            os.kill(pid, signal.SIGKILL)
        assert stop.returncode == 0, stop.stderr
        assert not left, f"process groups left running after stop: {left}"


@contextmanager
def parrot_d2(home: Path, model: str, admin_key: str) -> Iterator[tuple[Areal, str]]:
    """Two CPU SGLang replicas of tiny-parrot as `model`, without supervision (a watchdog
    restarting a killed or drained engine would take the cores the other one needs)."""
    with cli_service(
        home,
        "--model", model,
        "--backend", "sglang:d2",
        "--model-path", str(PARROT),
        # Room for ~20 long sequences at once (the CPU default, 4096, queues some of them).
        "--engine-args", "--max-total-tokens 16384",
        "--admin-api-key", admin_key,
        "--no-supervise",
    ) as running:  # fmt: skip
        yield running
