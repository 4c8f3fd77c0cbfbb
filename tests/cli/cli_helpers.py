"""Helpers for the `areal inf` suites: the real binaries, a temporary AREAL_HOME.

Every test runs `areal` as a user would (a subprocess with the workspace venv's
bin on PATH) against the real areal-gateway / areal-router / areal-proxy and,
where a model is needed, a real SGLang engine on the CPU (tiny-parrot).
After each test no process started under its AREAL_HOME may remain.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_cli import supervisor

ROOT = Path(__file__).resolve().parents[2]
PARROT = ROOT / "models" / "tiny-parrot"
BIN = Path(sys.executable).parent
BINARIES = ("areal-gateway", "areal-router", "areal-proxy")
ADMIN_KEY = "areal-admin-key"


def _binaries_missing() -> list[str]:
    return [b for b in BINARIES if not (shutil.which(b) or (BIN / b).exists())]


def engine_available() -> bool:
    from areal_cli import engines
    from areal_cli.errors import CLIError

    try:
        engines.resolve_python("sglang")
    except CLIError:
        return False
    return True


needs_binaries = pytest.mark.skipif(
    bool(_binaries_missing()), reason=f"service binaries not installed: {_binaries_missing()}"
)
needs_engine = pytest.mark.skipif(not engine_available(), reason="no SGLang engine installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Areal:
    """Runs `areal ...` with a private AREAL_HOME and the venv's bin first on PATH."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if k != "AREAL_ADMIN_API_KEY"}
        self.env["AREAL_HOME"] = str(home)
        self.env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU engine through the default engine args

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "areal_cli.main", *args]

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 600) -> Result:
        p = subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
            cwd=ROOT,
        )
        return Result(p.returncode, p.stdout, p.stderr)

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """The command as a terminal starts it. The tests send it Ctrl-C (SIGINT): a suite
        run in the background of a non-interactive shell inherits SIGINT ignored, and so
        would the command, which then could not be interrupted."""
        return subprocess.Popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, **(env or {})},
            cwd=ROOT,
            preexec_fn=_default_sigint,
        )

    def processes(self) -> list[int]:
        """Live processes started under this AREAL_HOME (it is in their environment), but
        not the CLI itself (a foreground run under test)."""
        return supervisor.processes_with_env(
            f"AREAL_HOME={self.home}", cmdline=lambda argv: "areal_cli.main" not in argv
        )

    def wait_no_processes(self, timeout: float = 15.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill_leftovers(self) -> list[int]:
        left = self.wait_no_processes(5)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def wait_status(self, want: str, service: str = "default", timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        rows: list = []
        while time.monotonic() < deadline:
            r = self("inf", "ps", "--all", "--json")
            rows = [x for x in json.loads(r.out or "[]") if x["service"] == service]
            if rows and rows[0]["status"] == want:
                return rows[0]
            time.sleep(0.2)
        raise AssertionError(f"service {service} not {want}: {rows}")


def process_group_members(pgids: set[int]) -> list[int]:
    """Every live process in one of `pgids` (an engine's scheduler renames itself and
    rewrites its environment, so it is found by its group, not by AREAL_HOME)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in pgids:  # fields after the command: state, ppid, pgrp
            pids.append(int(d))
    return pids


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every TCP socket in LISTEN that `pids` hold open,
    read from /proc (no ss/netstat needed). Addresses are printed like ss does:
    '0.0.0.0', '127.0.0.1', '::', '::1', '::ffff:127.0.0.1'."""
    listening: dict[str, tuple[str, int]] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw)
            listening[f[9]] = (addr, int(hexport, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and (hit := listening.get(target[8:-1])):
                found.append((pid, *hit))
    return found
