"""ps / status reconciliation and stop, with real `sleep` processes as stand-in components."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from areal_cli import lifecycle, service_logs, supervisor
from areal_cli import state as st


@pytest.fixture
def spawned(tmp_path):
    procs = []

    def make(name, role, **meta):
        proc, comp = supervisor.spawn(
            name, ["sleep", "60"], tmp_path / f"{name}.log", meta={"role": role, **meta}
        )
        procs.append(proc)
        return comp

    yield make
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _inf_state(comps, **extra):
    return {
        "service": "svc",
        "phase": "running",
        "gateway": {"url": "http://127.0.0.1:1"},
        "router": {"address": "127.0.0.1:2"},
        "components": {c.name: c.to_dict() for c in comps},
        "models": {
            "m": {
                "backend": "sglang:d1t1p1",
                "replicas": [
                    {"rank": 0, "gpus": [], "worker": "m-worker-0", "data_proxy": "m-data-proxy-0"}
                ],
            }
        },
        **extra,
    }


def _kill(comp):
    os.killpg(comp.pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while supervisor.group_alive(comp) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_running_degraded_stale(home, spawned):
    comps = [
        spawned("gateway", "gateway"),
        spawned("router", "router"),
        spawned("m-worker-0", "engine"),
        spawned("m-data-proxy-0", "proxy"),
    ]
    st.save("inf", "svc", _inf_state(comps))
    assert [r["status"] for r in lifecycle.ps_rows("inf", include_stale=False)] == ["running"]
    _kill(comps[3])
    rows = lifecycle.ps_rows("inf", include_stale=False)
    assert rows[0]["status"] == "degraded" and rows[0]["dead"] == ["m-data-proxy-0"]
    _kill(comps[0])
    assert lifecycle.ps_rows("inf", include_stale=False) == []
    rows = lifecycle.ps_rows("inf", include_stale=True)
    assert rows[0]["status"] == "stale"


def test_reused_pid_is_not_alive(home, spawned):
    gw = spawned("gateway", "gateway")
    forged = supervisor.Component.from_dict({**gw.to_dict(), "start_time": gw.start_time + 5})
    st.save("inf", "svc", _inf_state([forged]))
    assert lifecycle.ps_rows("inf", include_stale=True)[0]["status"] == "stale"


def test_starting_while_owner_lives(home, spawned):
    me = {"pid": os.getpid(), "start_time": supervisor.proc_start_time(os.getpid())}
    st.save("inf", "svc", _inf_state([], phase="starting", owner=me))
    assert lifecycle.ps_rows("inf", include_stale=False)[0]["status"] == "starting"


def test_status_json_shape_inf(home, spawned, capsys):
    comps = [
        spawned("gateway", "gateway", url="http://127.0.0.1:1"),
        spawned("router", "router"),
        spawned("m-worker-0", "engine"),
        spawned("m-data-proxy-0", "proxy"),
    ]
    st.save("inf", "svc", _inf_state(comps))
    assert lifecycle.status("inf", "svc", as_json=True, watch=False, interval=1) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gateway"]["url"] == "http://127.0.0.1:1"
    assert doc["gateway"]["alive"] is True
    assert doc["gateway"]["healthy"] is False  # a sleep is no gateway: nothing answers /health
    assert doc["router"]["address"] == "127.0.0.1:2"
    rep = doc["models"][0]["replicas"][0]
    assert rep["worker"]["name"] == "m-worker-0" and rep["data_proxy"]["status"] == "running"
    assert set(doc["components"]) == {"gateway", "router", "m-worker-0", "m-data-proxy-0"}


def test_status_json_shape_agent(home, spawned, capsys):
    comps = [spawned("gateway", "gateway"), spawned("router", "router")]
    pairs = []
    for i in range(2):
        comps += [spawned(f"worker-{i}", "worker"), spawned(f"proxy-{i}", "proxy")]
        pairs.append({"index": i, "worker": f"worker-{i}", "proxy": f"proxy-{i}"})
    st.save(
        "agent",
        "a",
        {
            "phase": "running",
            "agent": "x.y.Z",
            "gateway": {"url": "http://h:1"},
            "components": {c.name: c.to_dict() for c in comps},
            "pairs": pairs,
        },
    )
    lifecycle.status("agent", "a", as_json=True, watch=False, interval=1)
    doc = json.loads(capsys.readouterr().out)
    assert [p["worker"]["name"] for p in doc["pairs"]] == ["worker-0", "worker-1"]
    assert doc["gateway"]["url"] == "http://h:1"
    lifecycle.ps("agent", as_json=False, include_stale=False)
    assert "x.y.Z" in capsys.readouterr().out


def test_stop_parallel_ordered_and_removes_state(home, spawned, capsys):
    comps = [
        spawned("gateway", "gateway"),
        spawned("router", "router"),
        spawned("m-worker-0", "engine"),
        spawned("m-data-proxy-0", "proxy"),
    ]
    st.save("inf", "svc", _inf_state(comps))
    st.save_secrets("inf", "svc", {"admin_api_key": "k"})
    t0 = time.monotonic()
    assert lifecycle.stop("inf", "svc", force=False, grace=5, keep_state=False) == 0
    assert time.monotonic() - t0 < 2.5
    assert not any(supervisor.group_alive(c) for c in comps)
    assert st.load("inf", "svc") is None and not st.secrets_path("inf", "svc").exists()


def test_stop_keep_state(home, spawned, capsys):
    comps = [spawned("gateway", "gateway")]
    st.save("inf", "svc", _inf_state(comps))
    lifecycle.stop("inf", "svc", force=True, grace=5, keep_state=True)
    assert st.load("inf", "svc")["phase"] == "stopped"
    assert lifecycle.ps_rows("inf", include_stale=True)[0]["status"] == "stopped"


def test_stop_tiers_order():
    def c(name, role):
        return supervisor.Component(name, 1, 1, 1, [], "", meta={"role": role})

    tiers = lifecycle.stop_tiers(
        [c("r", "router"), c("g", "gateway"), c("e", "engine"), c("p", "proxy")]
    )
    assert [[x.name for x in t] for t in tiers] == [["p"], ["e"], ["g"], ["r"]]


def test_logs_unknown_component_lists_names(home, spawned, capsys):
    from areal_cli.errors import CLIError

    d = st.logs_dir("inf", "svc")
    d.mkdir(parents=True)
    (d / "gateway.log").write_text("a\nb\nc\n")
    (d / "router.log").write_text("r\n")
    with pytest.raises(CLIError) as info:
        service_logs.logs("inf", "svc", "gatewya", follow=False, lines=5)
    assert "available: gateway, router" in info.value.message
    service_logs.logs("inf", "svc", "gateway", follow=False, lines=2)
    assert capsys.readouterr().out == "b\nc\n"
