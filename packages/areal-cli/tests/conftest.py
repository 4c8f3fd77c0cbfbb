"""Fixtures: a temporary AREAL_HOME, stand-in service binaries, and a CLI runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_cli import supervisor

FAKE = Path(__file__).parent / "fakes" / "fake_service.py"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("AREAL_HOME", str(h))
    monkeypatch.delenv("AREAL_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return h


@dataclass
class Result:
    code: int
    out: str
    err: str


@dataclass
class Fakes:
    home: Path
    bin: Path
    env: dict[str, str]

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Result:
        p = subprocess.run(
            [sys.executable, "-m", "areal_cli.main", *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
        )
        return Result(p.returncode, p.stdout, p.stderr)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "areal_cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env, **(env or {})},
        )

    def pids(self) -> list[int]:
        """Live stand-in service processes started under this home (seen in their environment)."""
        return supervisor.processes_with_env(
            f"AREAL_HOME={self.home}", cmdline=lambda argv: any(FAKE.name in a for a in argv)
        )

    def wait_gone(self, timeout: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.pids()

    def kill_leftovers(self, timeout: float = 5.0) -> list[int]:
        """After a test: SIGKILL the stand-ins still running after `timeout`; their pids."""
        left = self.wait_gone(timeout)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def _wrapper(path: Path, role: str) -> None:
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" {role} "$@"\n')
    path.chmod(0o755)


@pytest.fixture
def fakes(home, tmp_path):
    """Stand-in binaries configured in $AREAL_HOME/inf/config.toml; no GPU visible."""
    b = tmp_path / "bin"
    b.mkdir()
    for role in ("gateway", "router", "proxy", "engine"):
        _wrapper(b / f"fake-{role}", role)
    (home / "inf").mkdir()
    (home / "inf" / "config.toml").write_text(
        "[binaries]\n"
        f'gateway = "{b}/fake-gateway"\n'
        f'router = "{b}/fake-router"\n'
        f'proxy = "{b}/fake-proxy"\n'
        "[engine.sglang]\n"
        f'python = "{b}/fake-engine"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",)}
    env["AREAL_HOME"] = str(home)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return Fakes(home, b, env)
