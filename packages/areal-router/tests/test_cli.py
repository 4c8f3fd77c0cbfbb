"""The `areal-router` console script as a real process: --version, ready file, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router import __version__
from areal_router.store import read_state

pytestmark = pytest.mark.timeout(60)


def router_command() -> list[str]:
    script = Path(sys.executable).with_name("areal-router")
    if script.exists():
        return [str(script)]
    found = shutil.which("areal-router")
    return [found] if found else [sys.executable, "-m", "areal_router"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AREAL_ROUTER_") and k != "AREAL_INTERNAL_TOKEN"
    }
    env.update(extra)
    return env


def test_version():
    out = subprocess.run(
        [*router_command(), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 0
    assert out.stdout.strip() == f"areal-router {__version__}"


def test_bad_flag_and_bad_state_file_fail_fast(tmp_path):
    out = subprocess.run(
        [*router_command(), "--policy", "fastest"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2 and "fastest" in out.stderr
    state = tmp_path / "state.json"
    state.write_text("garbage")
    out = subprocess.run(
        [*router_command(), "--state-file", str(state), "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 1 and "not a router state" in out.stderr
    assert state.read_text() == "garbage"  # never overwritten


def test_ready_file_health_and_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    state = tmp_path / "state" / "router.json"
    proc = subprocess.Popen(
        [*router_command(), "--ready-file", str(ready), "--state-file", str(state)],
        env=clean_env(AREAL_ROUTER_POLICY="least_loaded", AREAL_ROUTER_DRAIN_TIMEOUT="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert stat.S_IMODE(os.stat(ready).st_mode) == 0o600
        assert info["pid"] == proc.pid and info["host"] == "127.0.0.1"
        assert info["port"] > 0 and info["metrics_port"] > 0
        assert info["version"] == __version__ and info["policy"] == "least_loaded"
        assert info["started_at"] > 0

        with grpc.insecure_channel(f"127.0.0.1:{info['port']}") as channel:
            r = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            router_pb2_grpc.RouterServiceStub(channel).RegisterModel(
                router_pb2.RegisterModelRequest(model=router_pb2.ModelInfo(name="m")), timeout=5
            )

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err.decode()
        assert "stopped" in err.decode()
        # Nothing persisted is removed: the state keeps the model, the ready file stays.
        saved = read_state(state)
        assert [m["name"] for m in saved["models"]] == ["m"]
        assert ready.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
