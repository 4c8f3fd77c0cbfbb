"""Gateways on other nodes ([scheduler] gateway_nodes) without Ray: the unit a gateway's
host is given, that unit run by a real UnitHost, and the checks of the setting.
(tests/cluster/test_ray_inf.py runs a real one on a second node.)"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import pytest

from areal_cli import supervisor
from areal_cli.cluster import ray_scheduler as rs
from areal_cli.cluster.ray_gateways import gateway_unit
from areal_cli.config import Config
from areal_cli.errors import CLIError

SECRETS = {"AREAL_INTERNAL_TOKEN": "tok-123", "AREAL_SESSION_KEY_SECRET": "sks-456"}
ADMIN = "admin-789"


def _launcher(tmp_path: Path, shared: str = "") -> types.SimpleNamespace:
    return types.SimpleNamespace(
        group="inf",
        service="svc",
        state={"ray": {"shared_dir": shared}, "supervision": {}},
        env={"AREAL_INTERNAL_TOKEN": SECRETS["AREAL_INTERNAL_TOKEN"], "AREAL_TLS_CA": "/x"},
        gateway_env={"AREAL_SESSION_KEY_SECRET": SECRETS["AREAL_SESSION_KEY_SECRET"]},
    )


def _unit(tmp_path: Path, gateway_bin: str, args: list[str]) -> dict:
    return gateway_unit(
        _launcher(tmp_path),  # type: ignore[arg-type]
        "gateway-remote-0",
        gateway_bin=gateway_bin,
        port=18080,
        args=args,
        router_address="10.0.0.11:4000",
        admin_api_key=ADMIN,
        tls={"ca_cert": "CA", "cert": "CERT", "key": "KEY"},
        timeout=30,
    )


def test_the_unit_binds_the_nodes_address_and_keeps_secrets_off_argv(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_HOME", str(tmp_path))
    unit = _unit(
        tmp_path,
        "/opt/bin/areal-gateway",
        ["--log-level", "info", "--response-store", "/cli-node/responses.sqlite"],
    )
    [proc] = unit["processes"]
    argv = proc["argv"]
    assert argv[:5] == ["/opt/bin/areal-gateway", "--host", "{node_ip}", "--port", "18080"]
    assert argv[argv.index("--ready-file") + 1] == "{run}/gateway-remote-0.ready"
    # The CLI node's store is not on the other node: the host's data folder (shared_dir or
    # the node's own).
    assert argv[argv.index("--response-store") + 1] == "{data}/responses.sqlite"
    assert "/cli-node/responses.sqlite" not in argv
    assert argv[-2:] == ["--router-addr", "10.0.0.11:4000"]
    assert proc["address"] == "{node_ip}:18080"
    assert proc["env"] == {**SECRETS, "AREAL_ADMIN_API_KEY": ADMIN}  # no local TLS paths
    for secret in (*SECRETS.values(), ADMIN):
        assert not any(secret in a for a in argv)
    assert unit["tls"] == {"ca_cert": "CA", "cert": "CERT", "key": "KEY"}
    assert unit["needs"] == [("the areal-gateway binary", "/opt/bin/areal-gateway")]


# A stand-in gateway: its ready file (pid, port) and its environment's secrets, then sleep.
FAKE_GATEWAY = """#!{python}
import json, os, sys, time
a = sys.argv
open(a[a.index("--ready-file") + 1], "w").write(
    json.dumps({{"pid": os.getpid(), "port": int(a[a.index("--port") + 1])}})
)
print("serving", a[a.index("--host") + 1], flush=True)
time.sleep(600)
"""


def test_a_host_runs_the_gateway_unit_at_the_services_port(monkeypatch, tmp_path):
    from areal_cli.cluster.host import UnitHost

    monkeypatch.setenv("AREAL_HOME", str(tmp_path))
    ctx = types.SimpleNamespace(get_node_id=lambda: "f" * 20, was_current_actor_reconstructed=False)
    mod = types.ModuleType("ray")
    mod.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")  # type: ignore[attr-defined]
    mod.get_runtime_context = lambda: ctx  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", mod)
    fake = tmp_path / "areal-gateway"
    fake.write_text(FAKE_GATEWAY.format(python=sys.executable))
    fake.chmod(0o700)
    port = supervisor.free_port("127.0.0.1")
    unit = _unit(tmp_path, str(fake), ["--response-store", "/elsewhere.sqlite"])
    unit["processes"][0]["argv"][4] = str(port)
    unit["processes"][0]["address"] = "{node_ip}:" + str(port)
    host = UnitHost(unit)
    try:
        deadline = time.monotonic() + 30
        while host.info()["phase"] != "ready":
            assert host.info()["phase"] != "failed", host.info()["error"]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc = host.info()["processes"]["gateway-remote-0"]
        assert proc["address"] == f"127.0.0.1:{port}" and proc["port"] == port
        environ = Path(f"/proc/{proc['pid']}/environ").read_bytes().split(b"\0")
        assert f"AREAL_ADMIN_API_KEY={ADMIN}".encode() in environ
        assert b"AREAL_SESSION_KEY_SECRET=sks-456" in environ
        # The service's TLS as files on the node, named in its env (not the CLI node's paths).
        ca = next(e for e in environ if e.startswith(b"AREAL_TLS_CA="))[13:].decode()
        assert Path(ca).read_text() == "CA" and os.stat(ca).st_mode & 0o777 == 0o600
        data, _, _ = host.read_log("gateway-remote-0", 0)
        assert b"serving 127.0.0.1" in data
        assert ADMIN.encode() not in data and b"sks-456" not in data
    finally:
        assert host.stop(grace=2.0) == []


def _cfg(nodes: object) -> Config:
    return Config("inf", {"scheduler": {"gateway_nodes": nodes}}, [])


def test_gateway_nodes_must_be_distinct_addresses():
    assert rs.gateway_nodes(_cfg(["10.0.0.12", " 10.0.0.13 "])) == ["10.0.0.12", "10.0.0.13"]
    assert rs.gateway_nodes(Config("inf", {}, [])) == []
    with pytest.raises(CLIError, match="must be a list of node addresses") as e:
        rs.gateway_nodes(_cfg(["10.0.0.12", 3]))
    assert e.value.code == 2
    with pytest.raises(CLIError, match=r"10\.0\.0\.12 more than once"):
        rs.gateway_nodes(_cfg(["10.0.0.12", "10.0.0.12"]))


def test_gateway_nodes_must_be_live_nodes_other_than_the_clis():
    ray = types.SimpleNamespace(
        nodes=lambda: [
            {"NodeManagerAddress": "10.0.0.11", "Alive": True},
            {"NodeManagerAddress": "10.0.0.12", "Alive": True},
            {"NodeManagerAddress": "10.0.0.13", "Alive": False},
        ]
    )
    here = {"driver_node": "10.0.0.11"}
    rs.check_gateway_nodes(ray, {**here, "gateway_nodes": ["10.0.0.12"]})
    with pytest.raises(CLIError, match=r"10\.0\.0\.13 is not a live node") as e:
        rs.check_gateway_nodes(ray, {**here, "gateway_nodes": ["10.0.0.12", "10.0.0.13"]})
    assert "10.0.0.11, 10.0.0.12" in str(e.value) and e.value.code == 2
    with pytest.raises(CLIError, match="--gateways N"):
        rs.check_gateway_nodes(ray, {**here, "gateway_nodes": ["10.0.0.11"]})


def test_with_a_shared_dir_every_gateway_shares_one_responses_store(monkeypatch, tmp_path):
    from areal_cli.inf.launch import response_store

    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    shared = tmp_path / "shared"
    ray = {"shared_dir": str(shared), "gateway_nodes": ["10.0.0.12"]}
    launcher = types.SimpleNamespace(group="inf", service="svc", state={"ray": ray})
    # The folder a unit host fills in for `{data}` with a shared_dir (cluster/host.py).
    store = shared / "inf" / "svc" / "responses.sqlite"
    store.parent.mkdir(parents=True)
    store.write_text("last run's")
    assert response_store(launcher) == store  # type: ignore[arg-type]
    assert not store.exists()  # a new run starts without the last run's
    ray["gateway_nodes"] = []
    assert response_store(launcher).parent.name == "svc"  # type: ignore[arg-type]
    assert not response_store(launcher).is_relative_to(shared)  # type: ignore[arg-type]


def test_ps_lists_the_gateways_on_other_nodes():
    from areal_cli.components import Component
    from areal_cli.lifecycle import _gateway_urls

    def gw(name: str, **meta: str) -> Component:
        return Component(name, 0, 0, 0, [], "", meta={"role": "gateway", **meta})

    comps = {
        "gateway": gw("gateway", url="http://10.0.0.11:8080"),
        "gateway-1": gw("gateway-1", url="http://10.0.0.11:8080", shared="1"),
        "gateway-remote-0": gw("gateway-remote-0", actor="a", url="http://10.0.0.12:8080"),
        "router": Component("router", 0, 0, 0, [], "", meta={"role": "router"}),
    }
    s = {"gateway": {"url": "http://10.0.0.11:8080"}}
    assert _gateway_urls(s, comps) == ["http://10.0.0.11:8080", "http://10.0.0.12:8080"]
