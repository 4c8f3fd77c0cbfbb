"""UnitHost, the body of a cluster node's host actor, run here without Ray: real processes
started from placeholder specs, restarted when they die, stopped; what a unit placed again
on a fresh node tells its proxy. (tests/cluster runs it as a real Ray actor.)"""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

from areal_cli import supervisor


@pytest.fixture
def fake_ray(monkeypatch):
    """The two things UnitHost asks Ray: its node's address and its restart history."""
    ctx = types.SimpleNamespace(
        get_node_id=lambda: "a1b2c3d4e5f6a7b8c9d0", was_current_actor_reconstructed=False
    )
    mod = types.ModuleType("ray")
    mod.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")
    mod.get_runtime_context = lambda: ctx
    monkeypatch.setitem(sys.modules, "ray", mod)
    return ctx


# A tiny server: writes its ready file (pid and port) and sleeps until killed.
SERVER = (
    "import json, os, sys, time; "
    "open(sys.argv[1], 'w').write(json.dumps({'pid': os.getpid(), 'port': int(sys.argv[2])})); "
    "time.sleep(600)"
)


def _unit(tmp_path: Path, **extra) -> dict:
    return {
        "group": "inf",
        "service": "svc",
        "name": "m-0",
        "base_dir": str(tmp_path / "ray"),
        "supervision": {"backoff_initial": 0.1, "backoff_max": 0.2},
        "processes": [
            {
                "name": "m-data-proxy-0",
                "argv": [
                    sys.executable,
                    "-c",
                    SERVER,
                    "{run}/m-data-proxy-0.ready",
                    "{port:proxy}",
                ],
                "env": {"WHERE": "{node_ip}:{port:proxy} {data}"},
                "ready": {"file": True},
                "timeout": 30,
                "address_port": "proxy",
            }
        ],
        **extra,
    }


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_starts_fills_placeholders_restarts_a_dead_process_and_stops(tmp_path, fake_ray):
    from areal_cli.cluster.host import UnitHost

    host = UnitHost(_unit(tmp_path))
    try:
        _wait(lambda: host.info()["phase"] == "ready")
        proc = host.info()["processes"]["m-data-proxy-0"]
        port = proc["port"]
        assert proc["address"] == f"127.0.0.1:{port}" and proc["alive"]
        environ = Path(f"/proc/{proc['pid']}/environ").read_bytes().split(b"\0")
        data_dir = tmp_path / "ray" / "svc" / "m-0" / "data" / "a1b2c3d4e5f6"
        assert f"WHERE=127.0.0.1:{port} {data_dir}".encode() in environ
        assert b"AREAL_PROXY_LOST_DATA" not in b"\0".join(environ)  # first placement
        os.kill(proc["pid"], signal.SIGKILL)
        _wait(lambda: host.info()["processes"]["m-data-proxy-0"]["restarts"] == 1)
        _wait(lambda: host.info()["processes"]["m-data-proxy-0"]["state"] == "running")
        again = host.info()["processes"]["m-data-proxy-0"]
        assert again["pid"] != proc["pid"] and again["port"] == port  # same address
        data, offset, size = host.read_log("m-data-proxy-0", 0)
        assert data.count(b"starting m-data-proxy-0") == 2 and offset == size
    finally:
        assert host.stop(grace=2.0) == []
    assert supervisor.proc_start_time(again["pid"]) is None  # gone, and reaped


def test_placed_again_on_a_fresh_node_without_a_shared_dir_says_the_data_is_lost(
    tmp_path, fake_ray
):
    from areal_cli.cluster.host import LOST_DATA_ENV, UnitHost

    fake_ray.was_current_actor_reconstructed = True
    host = UnitHost(_unit(tmp_path))
    try:
        assert "placed again on node 127.0.0.1" in host.env[LOST_DATA_ENV]
        assert "shared_dir" in host.env[LOST_DATA_ENV]
    finally:
        host.stop(grace=1.0)
    # Restarted where its data is (the same node: the folder has its database): nothing lost.
    (host.dirs["data"] / "m-data-proxy-0.sqlite").write_bytes(b"")
    again = UnitHost(_unit(tmp_path))
    try:
        assert LOST_DATA_ENV not in again.env
    finally:
        again.stop(grace=1.0)
    # With a shared directory the data is never the node's: nothing lost either.
    shared = UnitHost(_unit(tmp_path / "other", shared_dir=str(tmp_path / "shared")))
    try:
        assert LOST_DATA_ENV not in shared.env
        assert shared.dirs["data"] == tmp_path / "shared" / "inf" / "svc"
    finally:
        shared.stop(grace=1.0)


def test_a_node_lacking_what_the_unit_needs_fails_before_anything_starts(tmp_path, fake_ray):
    from areal_cli.cluster.host import UnitHost

    host = UnitHost(_unit(tmp_path, needs=[("the model folder", str(tmp_path / "nope"))]))
    try:
        _wait(lambda: host.info()["phase"] == "failed")
        err = host.info()["error"]
        assert "node 127.0.0.1 lacks the model folder" in err and str(tmp_path / "nope") in err
        assert host.info()["processes"] == {}
    finally:
        host.stop(grace=1.0)


def test_without_supervision_a_dead_process_stays_dead(tmp_path, fake_ray):
    from areal_cli.cluster.host import UnitHost

    unit = _unit(tmp_path)
    unit["supervision"] = {"enabled": False}
    host = UnitHost(unit)
    try:
        _wait(lambda: host.info()["phase"] == "ready")
        pid = host.info()["processes"]["m-data-proxy-0"]["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: host.info()["processes"]["m-data-proxy-0"]["state"] == "dead")
        time.sleep(0.5)
        assert host.info()["processes"]["m-data-proxy-0"]["restarts"] == 0
    finally:
        host.stop(grace=1.0)
