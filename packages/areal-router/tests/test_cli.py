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


def _start_router(tmp_path: Path, state: Path, name: str) -> tuple[subprocess.Popen, int]:
    ready = tmp_path / f"{name}.json"
    flags = ["--ready-file", str(ready), "--state-file", str(state)]
    flags += ["--metrics-port", "-1", "--health-interval", "0.1"]
    proc = subprocess.Popen(
        [*router_command(), *flags],
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < deadline, "no ready file"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["port"]


def test_sigkill_right_after_acknowledged_binds_loses_none(tmp_path):
    """Group commit acknowledges each bind only once its batch is fsynced: a router killed
    the moment the last of 64 concurrent binds was answered restarts with all of them."""
    from concurrent.futures import ThreadPoolExecutor

    from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc

    class Proxy(proxy_pb2_grpc.ProxyStatusServiceServicer):
        def GetStats(self, request, context):
            return proxy_pb2.ProxyStats(healthy=True, model="m")

    fake = grpc.server(ThreadPoolExecutor(max_workers=2))
    proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(Proxy(), fake)
    fake_port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    state = tmp_path / "router-state.db"
    proc, port = _start_router(tmp_path, state, "ready-1")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            stub.RegisterProxy(
                router_pb2.RegisterProxyRequest(
                    proxy=router_pb2.ProxyInfo(
                        proxy_id="p0", address=f"127.0.0.1:{fake_port}", model="m"
                    )
                ),
                timeout=10,
            )

            def bind(i: int) -> list[str]:
                ids = [f"group:g{i}", f"s{i}"]
                stub.BindSession(
                    router_pb2.BindSessionRequest(session_ids=ids, model="m"), timeout=10
                )
                return ids

            with ThreadPoolExecutor(max_workers=16) as pool:
                acknowledged = [sid for ids in pool.map(bind, range(64)) for sid in ids]
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert len(acknowledged) == 128
        proc, port = _start_router(tmp_path, state, "ready-2")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            where = [
                stub.Route(router_pb2.RouteRequest(session_id=sid), timeout=10).proxy_id
                for sid in acknowledged
            ]
        assert set(where) == {"p0"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        fake.stop(0)
