"""Lifecycle and failure paths of `areal inf` with the real binaries (no engine unless noted)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from cli_helpers import ADMIN_KEY, BIN, PARROT, free_port, needs_binaries, needs_engine

pytestmark = needs_binaries


def test_empty_service_as_in_the_guide(areal, tmp_path):
    port = free_port()
    t0 = time.monotonic()
    r = areal(
        "inf", "run", "--service", "default", "--host", "127.0.0.1", "--port", str(port),
        "--admin-api-key", ADMIN_KEY, "--scheduler", "local", "--detach",
    )  # fmt: skip
    took = time.monotonic() - t0
    assert r.code == 0, r.err
    assert took < 30
    doc = areal("inf", "status", "--service", "default", "--json").json()
    assert doc["gateway"]["url"] == f"http://127.0.0.1:{port}" and doc["gateway"]["healthy"]
    assert doc["scheduler"] == "local"
    state = (areal.home / "inf" / "services" / "default.json").read_text()
    assert ADMIN_KEY not in state
    assert areal("inf", "models", "--service", "default").code == 0
    t0 = time.monotonic()
    assert areal("inf", "stop", "--service", "default").code == 0
    assert time.monotonic() - t0 < 15
    assert not areal.wait_no_processes(5)


def test_config_file_as_in_the_guide(areal, tmp_path):
    port = free_port()
    cfg = tmp_path / "inf.toml"
    cfg.write_text(
        f'[default]\nservice = "default"\n\n[launch]\ngateway_host = "127.0.0.1"\n'
        f'gateway_port = {port}\nrouting_strategy = "round_robin"\n\n[scheduler]\ntype = "local"\n'
    )
    r = areal("inf", "--config", str(cfg), "run", "--service", "default", "--detach")
    assert r.code == 0, r.err
    assert areal("inf", "status", "--json").json()["gateway"]["url"].endswith(f":{port}")
    assert areal("inf", "stop").code == 0


def test_foreground_run_ctrl_c(areal):
    p = areal.popen("inf", "run", "--port", str(free_port()), "--admin-api-key", ADMIN_KEY)
    areal.wait_status("running", timeout=60)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert not areal.wait_no_processes(5)
    assert areal("inf", "ps", "--all", "--json").json() == []


def test_foreground_gateway_death_tears_everything_down(areal):
    # Without supervision (with it, the watchdog restarts the gateway instead).
    p = areal.popen("inf", "run", "--port", str(free_port()), "--no-supervise")
    areal.wait_status("running", timeout=60)
    gw = areal("inf", "status", "--json").json()["gateway"]["pid"]
    os.kill(gw, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "gateway" in err and "torn down" in err
    assert not areal.wait_no_processes(10)
    assert areal("inf", "ps", "--all", "--json").json() == []


def test_killed_foreground_cli_then_run_force(areal):
    p = areal.popen("inf", "run", "--port", str(free_port()))
    areal.wait_status("running", timeout=60)
    old = set(areal.processes())
    p.kill()
    p.communicate()
    assert old and set(areal.processes()) == old  # orphans, recorded in state
    r = areal("inf", "run", "--port", str(free_port()), "--detach")
    assert r.code == 1 and "--force" in r.err
    r = areal("inf", "run", "--port", str(free_port()), "--detach", "--force")
    assert r.code == 0, r.err
    assert not old & set(areal.processes()), "recorded orphans must be killed"
    assert areal("inf", "stop").code == 0


def test_two_concurrent_runs_exactly_one_wins(areal):
    procs = [areal.popen("inf", "run", "--port", str(free_port()), "--detach") for _ in range(2)]
    results = [(*p.communicate(timeout=120), p.returncode) for p in procs]
    assert sorted(r[2] for r in results) == [0, 1], results
    loser = next(r for r in results if r[2] == 1)
    assert "busy" in loser[1] or "already running" in loser[1]
    assert areal("inf", "stop").code == 0


def test_port_in_use(areal):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = areal("inf", "run", "--port", str(s.getsockname()[1]), "--detach")
    assert r.code == 1 and "already in use" in r.err
    assert r.err.count("\n") == 1
    assert areal("inf", "ps", "--all", "--json").json() == []


def test_missing_binary(areal, tmp_path):
    # A PATH with areal-router and areal-proxy but no areal-gateway.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for b in ("areal-router", "areal-proxy"):
        (bin_dir / b).symlink_to(BIN / b)
    r = areal("inf", "run", "--detach", "--port", str(free_port()), env={"PATH": str(bin_dir)})
    assert r.code == 1 and "areal-gateway not found on PATH" in r.err
    assert areal("inf", "ps", "--all", "--json").json() == []


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("sglang:d1p2", "pipeline parallelism is not supported (use p1)"),
        ("tgi:d1", "unknown engine 'tgi'"),
        ("sglang:z3", "cannot parse 'z3'"),
    ],
)
def test_bad_backend(areal, backend, needle):
    r = areal(
        "inf", "run", "--detach", "--model", "m", "--model-path", str(PARROT), "--backend", backend
    )
    assert r.code == 2 and needle in r.err
    assert areal("inf", "ps", "--all", "--json").json() == []


def test_model_flags_require_model(areal):
    r = areal("inf", "run", "--detach", "--model-path", str(PARROT))
    assert r.code == 2 and "model registration flags require --model." in r.err


@needs_engine
@pytest.mark.engine
def test_engine_crash_via_bad_engine_args(areal):
    r = areal(
        "inf", "run", "--detach", "--port", str(free_port()), "--model", "m",
        "--model-path", str(PARROT), "--engine-args", "--no-such-engine-flag 1",
    )  # fmt: skip
    assert r.code == 1
    assert "m-worker-0 failed to start: process exited" in r.err
    assert "m-worker-0.log" in r.err and "no-such-engine-flag" in r.err
    assert not areal.wait_no_processes(10)
    assert areal("inf", "ps", "--all", "--json").json() == []


# sglang:d2 (two engine processes, `inf models` listing both, chats served by both) is
# tests/faults/test_faults.py's service: starting two more engines here cost ~2 minutes of CI.
