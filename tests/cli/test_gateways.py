"""`--gateways N`: several supervised gateway processes on one port (SO_REUSEPORT), with the
real binaries and no engine.

What a client sees is one address; what the operator sees is every gateway (status, ps,
logs, metrics), each reachable on a loopback port of its own; a killed one is restarted on
the shared port while the others serve it.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from cli_helpers import ADMIN_KEY, free_port, needs_binaries
from test_agent_service import ECHO, KEY, post

pytestmark = needs_binaries


def health_pid(url: str) -> int:
    """The pid of the gateway process that answered `url`/health on a new connection."""
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return int(json.loads(r.read())["pid"])


def gateways_of(doc: dict) -> dict[str, dict]:
    return {n: c for n, c in doc["components"].items() if c["role"] == "gateway"}


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not {what} after {timeout:g}s")


def test_two_gateways_share_one_port_and_a_killed_one_comes_back(areal):
    port = free_port()
    r = areal(
        "inf", "run", "--port", str(port), "--gateways", "2", "--admin-api-key", ADMIN_KEY,
        "--detach",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "2 gateways sharing the port" in r.err
    doc = areal("inf", "status", "--json").json()
    url = f"http://127.0.0.1:{port}"
    assert doc["gateway"]["url"] == url and doc["gateway"]["healthy"]
    assert doc["gateway"]["gateways"] == doc["gateway"]["gateways_healthy"] == 2
    gws = gateways_of(doc)
    assert sorted(gws) == ["gateway", "gateway-1"]
    # Each answers on its own port, as itself; its metrics are its own.
    own = {n: g["own_url"] for n, g in gws.items()}
    assert len(set(own.values())) == 2 and url not in own.values()
    for n, g in gws.items():
        assert g["healthy"] and health_pid(own[n]) == g["pid"]
        assert g["metrics_url"] == own[n] + "/metrics"
    # The shared port reaches both (new connections are spread by the kernel).
    seen = {health_pid(url) for _ in range(40)}
    assert seen == {g["pid"] for g in gws.values()}, seen
    assert "2 of 2 gateways answering" in areal("inf", "status").out
    assert f"{url} (2/2 gateways)" in areal("inf", "ps").out
    [row] = areal("inf", "ps", "--json").json()
    assert row["gateways"] == {"gateway": "running", "gateway-1": "running"}
    # One store of Responses, shared by both and private to the user.
    stores = {g["argv"][g["argv"].index("--response-store") + 1] for g in gws.values()}
    [store] = stores
    assert os.stat(store).st_mode & 0o777 == 0o600
    logs = areal("inf", "logs", "--component", "gateway-1", "--lines", "50")
    assert logs.code == 0 and "(shared)" in logs.out, logs.err

    # kill -9 one: the port keeps answering (the other), and the watchdog restarts it there.
    victim = gws["gateway-1"]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{victim}"), 5, "gone")
    answered = [health_pid(url) for _ in range(20)]
    # Every poll answered, none by the dead one; the watchdog may already have a new gateway-1
    # sharing the port again before the polls end.
    assert victim not in answered and gws["gateway"]["pid"] in answered, answered

    def back() -> dict | None:
        d = areal("inf", "status", "--json").json()
        g = gateways_of(d)["gateway-1"]
        ok = g["pid"] != victim and g["state"] == "running" and g.get("healthy")
        return d if ok else None

    doc = wait_for(back, 30, "restarted")
    g = gateways_of(doc)["gateway-1"]
    assert g["restarts"] == 1 and g["last_failure"]["reason"] == "process exited"
    assert health_pid(g["own_url"]) == g["pid"]
    assert doc["status"] == "running" and doc["gateway"]["gateways_healthy"] == 2
    assert areal("inf", "stop").code == 0
    assert not areal.wait_no_processes(5)


def test_one_of_two_gateways_dead_is_degraded_not_stale(areal):
    r = areal(
        "inf", "run", "--port", str(free_port()), "--gateways", "2", "--no-supervise",
        "--detach",
    )  # fmt: skip
    assert r.code == 0, r.err
    pid = gateways_of(areal("inf", "status", "--json").json())["gateway"]["pid"]
    os.kill(pid, signal.SIGKILL)
    row = areal.wait_status("degraded")
    assert row["dead"] == ["gateway"]
    assert row["gateways"] == {"gateway": "dead", "gateway-1": "running"}
    assert "(1/2 gateways)" in areal("inf", "ps").out
    # Commands that call the gateway go on through the live one (before: "not running").
    r = areal("inf", "models")
    assert r.code == 0 and "not running" not in r.out + r.err, r.out + r.err
    doc = areal("inf", "status", "--json").json()
    assert doc["gateway"]["healthy"] and doc["gateway"]["gateways_healthy"] == 1
    assert areal("inf", "stop").code == 0


def test_gateways_out_of_range_is_a_usage_error(areal, tmp_path):
    for n in ("0", "65"):
        r = areal("inf", "run", "--port", str(free_port()), "--gateways", n, "--detach")
        assert r.code == 2 and "--gateways must be between 1 and 64" in r.err, r.err
    cfg = tmp_path / "inf.toml"
    cfg.write_text('[launch]\ngateways = "two"\n')
    r = areal("inf", "--config", str(cfg), "run", "--detach")
    assert r.code != 0 and "gateways" in r.err and "Traceback" not in r.err
    assert areal("inf", "ps", "--all", "--json").json() == []


def test_agent_sessions_cross_gateways(areal, tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[run]\nagent = "{ECHO}"\ngateways = 2\n')
    r = areal("agent", "--config", str(cfg), "run", "--admin-api-key", KEY)
    assert r.code == 0, r.err
    doc = areal("agent", "status", "--json").json()
    a, b = (g["own_url"] for g in gateways_of(doc).values())
    code, sess = post(a + "/v1/sessions", KEY, {})
    assert code == 201, sess
    code, resp = post(b + "/v1/responses", sess["session_api_key"], {"input": "across"})
    assert code == 200, resp
    text = "".join(c["text"] for i in resp["output"] for c in i.get("content", []) if "text" in c)
    assert text == "across"
    assert areal("agent", "stop").code == 0
