"""Every `areal agent` command of docs/cli.md, run as written against the real binaries.

areal-router, areal-gateway (--mode agent), areal-agent-proxy and
areal-agent-worker with `examples.agents.echo.EchoAgent`, from the repository
root (the CLI puts its working directory first on the workers' PYTHONPATH). No
engine is needed. The `areal` fixture (conftest.py) gives each test a fresh
AREAL_HOME and asserts afterwards that no process started under it remains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from cli_helpers import BIN

AGENT_BINARIES = (
    "areal-gateway",
    "areal-router",
    "areal-agent-proxy",
    "areal-agent-worker",
)
MISSING = [b for b in AGENT_BINARIES if not (shutil.which(b) or (BIN / b).exists())]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"binaries not installed: {MISSING}")

KEY = "areal-agent-admin"
ECHO = "examples.agents.echo.EchoAgent"
RUN = ("agent", "run", "--service", "default", "--agent", ECHO)


def post(url: str, key: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read())


def talk(url: str, text: str = "hello agent world") -> str:
    """A session (admin key), then a Responses turn and a chat turn with the session key."""
    code, sess = post(url + "/v1/sessions", KEY, {})
    assert code == 201, sess
    skey = sess["session_api_key"]
    code, resp = post(url + "/v1/responses", skey, {"input": text})
    assert code == 200, resp
    out = "".join(
        c["text"] for item in resp["output"] for c in item.get("content", []) if "text" in c
    )
    assert out == text
    code, chat = post(
        url + "/v1/chat/completions",
        skey,
        {"model": "agent", "messages": [{"role": "user", "content": "second turn"}]},
    )
    assert code == 200, chat
    assert chat["choices"][0]["message"]["content"] == "second turn"
    return sess["session_id"]


def status_json(areal, service: str = "default") -> dict:
    r = areal("agent", "status", "--service", service, "--json")
    assert r.code == 0, r.err
    return r.json()


def jq_pairs_worker(doc: dict) -> list[dict]:
    """`jq '.pairs[].worker'`."""
    return [p["worker"] for p in doc["pairs"]]


def read_until(p: subprocess.Popen, needle: str, timeout: float = 20) -> str:
    """Lines of `p`'s stdout until one contains `needle`."""
    deadline = time.monotonic() + timeout
    seen = []
    assert p.stdout is not None
    os.set_blocking(p.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line:
            seen.append(line)
            if needle in line:
                return "".join(seen)
        else:
            time.sleep(0.05)
    raise AssertionError(f"{needle!r} not seen in: {''.join(seen)}")


def test_guide_walkthrough(areal):
    # Launching the service (minimum launch, exactly as written)
    t0 = time.monotonic()
    r = areal(*RUN, "--num-pairs", "1", "--admin-api-key", KEY)
    assert r.code == 0, r.err
    assert time.monotonic() - t0 < 30

    # Inspecting service state
    r = areal("agent", "ps")
    assert r.code == 0
    header, row = r.out.splitlines()[:2]
    assert header.split() == ["SERVICE", "STATUS", "GATEWAY", "AGENT"]
    assert row.split()[0:2] == ["default", "running"] and row.split()[3] == ECHO
    assert areal("agent", "ps", "--all").code == 0
    rows = areal("agent", "ps", "--json").json()
    assert [(x["service"], x["status"], x["agent"]) for x in rows] == [("default", "running", ECHO)]
    r = areal("agent", "status", "--service", "default")
    assert r.code == 0 and "healthy" in r.out
    for name in ("gateway", "router", "worker-0", "proxy-0"):
        assert name in r.out

    # --watch refreshes on an interval until Ctrl-C
    p = areal.popen("agent", "status", "--service", "default", "--watch", "--interval", "1")
    first = read_until(p, "every 1s")
    read_until(p, "every 1s")  # a second refresh
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=10)
    assert p.returncode == 0 and "worker-0" in first

    # JSON mode: jq '.pairs[].worker' and jq -r '.gateway.url'
    doc = status_json(areal)
    workers = jq_pairs_worker(doc)
    assert [w["name"] for w in workers] == ["worker-0"]
    assert workers[0]["alive"] and workers[0]["pid"] > 0 and workers[0]["address"]
    assert doc["pairs"][0]["proxy"]["name"] == "proxy-0" and doc["pairs"][0]["proxy"]["alive"]
    gateway_url = doc["gateway"]["url"]
    assert gateway_url.startswith("http://127.0.0.1:") and doc["gateway"]["healthy"]
    assert doc["router"]["alive"] and doc["agent"] == ECHO

    # Talking to the service: admin key -> session key -> turns
    talk(gateway_url)
    code, pairs = get(gateway_url + "/admin/pairs", KEY)
    assert code == 200 and [p["health"] for p in pairs["pairs"]] == ["healthy"]

    # Logs: each component has its own file; -f follows
    for comp in ("gateway", "router", "worker-0", "proxy-0"):
        r = areal("agent", "logs", "--service", "default", "--component", comp)
        assert r.code == 0 and f"starting {comp}" in r.out, (comp, r.err)
    p = areal.popen("agent", "logs", "--service", "default", "--component", "gateway", "-f")
    read_until(p, "listening on")
    time.sleep(0.5)
    sid = talk(gateway_url, "followed")  # new lines arrive while following
    read_until(p, f"session {sid} created", timeout=10)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=10)
    assert p.returncode == 0
    r = areal("agent", "logs", "--service", "default", "--component", "worker-7")
    assert r.code == 1
    assert "available: gateway, proxy-0, router, watchdog, worker-0" in r.err

    # The state file holds no secret
    state = (areal.home / "agent" / "services" / "default.json").read_text()
    assert KEY not in state

    # Stopping
    t0 = time.monotonic()
    r = areal("agent", "stop", "--service", "default")
    assert r.code == 0, r.err
    assert time.monotonic() - t0 < 15
    assert not areal.wait_no_processes(5)
    assert areal("agent", "ps", "--all", "--json").json() == []


def test_num_pairs_2_and_config_file(areal, tmp_path):
    cfg = tmp_path / "my-agent.toml"
    cfg.write_text(
        '[default]\nservice = "default"\nadmin_api_key = "areal-agent-admin"\nlog_level = "info"\n'
        f'\n[run]\nagent = "{ECHO}"\nnum_pairs = 2\nsetup_timeout = 120\n'
        "health_poll_interval = 5\ndrain_timeout = 30\nsession_timeout = 1800\n"
    )
    r = areal("agent", "--config", str(cfg), "run", "--service", "default", "--agent", ECHO)
    assert r.code == 0, r.err
    doc = status_json(areal)
    assert [w["name"] for w in jq_pairs_worker(doc)] == ["worker-0", "worker-1"]
    assert all(p["worker"]["alive"] and p["proxy"]["alive"] for p in doc["pairs"])
    url = doc["gateway"]["url"]
    code, pairs = get(url + "/admin/pairs", KEY)  # admin key from the config file
    assert code == 200
    assert sorted(p["proxy_id"] for p in pairs["pairs"]) == ["proxy-0", "proxy-1"]
    assert all(p["health"] == "healthy" for p in pairs["pairs"])
    for i in range(4):
        talk(url, f"turn {i}")
    code, pairs = get(url + "/admin/pairs", KEY)
    assert code == 200
    assert sum(p["sessions"] for p in pairs["pairs"]) >= 4
    assert all(p["sessions"] > 0 for p in pairs["pairs"]), pairs  # new sessions spread by load
    argv = doc["components"]["proxy-1"]["argv"]
    assert argv[argv.index("--drain-timeout") + 1] == "30"
    r = areal("agent", "stop", "--service", "default", "--force")
    assert r.code == 0 and "killed" in r.out
    assert not areal.wait_no_processes(5)


def test_bad_agent_fails_fast_and_leaves_nothing(areal):
    t0 = time.monotonic()
    r = areal(*RUN, "--agent", "examples.agents.nope.NoSuchAgent")
    assert r.code == 1
    last = r.err.strip().splitlines()[-1]
    assert last.startswith("error: worker-0 could not load the agent:")
    assert "No module named 'examples.agents.nope'" in last
    assert "Traceback" not in r.err
    assert time.monotonic() - t0 < 20
    assert not areal.wait_no_processes(5)
    assert not (areal.home / "agent" / "services" / "default.json").exists()
    assert not (areal.home / "agent" / "services" / "default.secrets").exists()
    r = areal("agent", "run", "--service", "default")
    assert r.code == 2 and r.err.strip() == "error: --agent is required"


def test_force_over_stale_state(areal):
    # Without supervision a dead gateway leaves stale state.
    assert areal(*RUN, "--num-pairs", "2", "--admin-api-key", KEY, "--no-supervise").code == 0
    old = status_json(areal)["components"]
    os.killpg(old["gateway"]["pgid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = areal("agent", "ps", "--all", "--json").json()
        if rows[0]["status"] == "stale":
            break
        time.sleep(0.1)
    assert rows[0]["status"] == "stale"
    assert areal("agent", "ps", "--json").json() == []  # stale rows only with --all
    r = areal(*RUN, "--admin-api-key", KEY)
    assert r.code == 1 and "--force" in r.err
    r = areal(*RUN, "--admin-api-key", KEY, "--force")
    assert r.code == 0, r.err
    live = set(areal.processes())
    assert not live & {c["pid"] for c in old.values()}, "recorded orphans survived --force"
    doc = status_json(areal)
    assert len(doc["pairs"]) == 1 and doc["gateway"]["healthy"]
    talk(doc["gateway"]["url"])
    assert areal("agent", "stop", "--service", "default").code == 0
    assert not areal.wait_no_processes(5)


def test_stop_keep_state(areal):
    assert areal(*RUN, "--admin-api-key", KEY).code == 0
    r = areal("agent", "stop", "--service", "default", "--keep-state")
    assert r.code == 0 and "state kept" in r.out
    assert not areal.wait_no_processes(5)
    assert (areal.home / "agent" / "services" / "default.json").exists()
    assert areal("agent", "ps", "--all", "--json").json()[0]["status"] == "stopped"
    assert areal("agent", "stop", "--service", "default").code == 0
    assert areal("agent", "ps", "--all", "--json").json() == []


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x]
    return {k.decode(): v.decode() for k, v in items}


def test_inf_service_link(areal):
    """--inf-service: the proxies get the inf gateway URL on argv and its key in the environment."""
    r = areal("inf", "run", "--service", "llm", "--port", "0", "--admin-api-key", "inf-key",
              "--detach")  # fmt: skip
    assert r.code == 0, r.err
    try:
        inf_url = areal("inf", "status", "--service", "llm", "--json").json()["gateway"]["url"]
        r = areal(*RUN, "--admin-api-key", KEY, "--inf-service", "llm", "--inf-model", "m")
        assert r.code == 0, r.err
        assert f"inf service 'llm', {inf_url}" in r.out
        proxy = status_json(areal)["components"]["proxy-0"]
        argv = proxy["argv"]
        assert argv[argv.index("--inf-gateway-url") + 1] == inf_url
        assert argv[argv.index("--inf-model") + 1] == "m"
        assert "inf-key" not in argv
        assert _environ(proxy["pid"])["AREAL_PROXY_INF_ADMIN_API_KEY"] == "inf-key"
        assert "inf-key" not in (areal.home / "agent" / "services" / "default.json").read_text()
        assert areal("agent", "stop", "--service", "default").code == 0
    finally:
        areal("inf", "stop", "--service", "llm", "--force")
    r = areal(*RUN, "--inf-service", "llm")
    assert r.code == 1 and "no inf service named 'llm'" in r.err
