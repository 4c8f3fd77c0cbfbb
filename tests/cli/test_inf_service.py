"""Every `areal inf` command of docs/cli.md, as written, on one shared service.

One real SGLang engine (tiny-parrot on the CPU, ~40 s to start) serves the whole
module: `run --model ... --detach` starts it, the tests inspect and use it, and
the last ones deregister, register again, break and stop it.
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

import httpx
import pytest
from cli_helpers import (
    ADMIN_KEY,
    PARROT,
    free_port,
    listening_sockets,
    needs_binaries,
    needs_engine,
    process_group_members,
)

pytestmark = [needs_binaries, needs_engine, pytest.mark.engine]

MODEL = "qwen-local"


@pytest.fixture(scope="module")
def svc(module_areal):
    a = module_areal
    port = free_port()
    r = a(
        "inf", "run",
        "--service", "default",
        "--port", str(port),
        "--admin-api-key", ADMIN_KEY,
        "--model", MODEL,
        "--backend", "sglang:d1",
        "--model-path", str(PARROT),
        "--proxy-args", "--request-timeout 120 --chat-template-type hf",
        "--detach",
    )  # fmt: skip
    assert r.code == 0, r.err
    return a, port


def test_ps_lists_the_service(svc):
    a, port = svc
    r = a("inf", "ps")
    assert r.code == 0
    assert "default" in r.out and "running" in r.out and f"http://127.0.0.1:{port}" in r.out
    rows = a("inf", "ps", "--json").json()
    assert rows[0]["models"] == [MODEL]


def test_status_drills_into_components(svc):
    a, port = svc
    r = a("inf", "status", "--service", "default")
    assert r.code == 0
    for name in ("gateway", "router", f"{MODEL}-worker-0", f"{MODEL}-data-proxy-0"):
        assert name in r.out
    doc = a("inf", "status", "--service", "default", "--json").json()
    assert doc["gateway"]["url"] == f"http://127.0.0.1:{port}"  # jq -r '.gateway.url'
    assert doc["gateway"]["healthy"] is True
    assert all(c["status"] == "running" for c in doc["components"].values())
    # Every component's metrics, where an operator scrapes them: each answers Prometheus text.
    comps = doc["components"]
    for name in ("gateway", "router", f"{MODEL}-data-proxy-0"):
        url = comps[name]["metrics_url"]
        assert url and url.startswith("http://127.0.0.1:"), (name, url)
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if name == "gateway" else {}
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 200 and "# TYPE" in r.text, (name, r.status_code)
    assert comps[f"{MODEL}-worker-0"]["metrics_url"] is None


def test_models_lists_the_model(svc):
    a, _ = svc
    r = a("inf", "models", "--service", "default")
    assert r.code == 0 and MODEL in r.out
    m = a("inf", "models", "--service", "default", "--json").json()["models"][0]
    assert m["name"] == MODEL and m["registered"] and m["managed"]
    assert [w["proxy_id"] for w in m["workers"]] == [f"{MODEL}-data-proxy-0"]


def test_nothing_listens_on_a_wildcard_address(svc):
    """Every socket every component (engine and its scheduler included) listens on is loopback."""
    a, port = svc
    comps = a("inf", "status", "--service", "default", "--json").json()["components"]
    pids = process_group_members({c["pgid"] for c in comps.values()})
    assert len(pids) > len(comps), "the engine's own processes were not found"
    found = listening_sockets(pids)
    assert any(p == port for _, _, p in found), f"the gateway's port is not among {found}"
    wildcard = [s for s in found if s[1] in ("0.0.0.0", "::")]
    assert not wildcard, f"listening on a wildcard address (pid, address, port): {wildcard}"
    loopback = ("127.", "::1", "::ffff:127.")
    assert all(addr.startswith(loopback) for _, addr, _ in found), found


def test_curl_chat_completion(svc):
    _, port = svc
    if not shutil.which("curl"):
        pytest.skip("curl not installed")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi, give me a quick intro to AReaL."}],
        "max_tokens": 128,
    }
    p = subprocess.run(
        [
            "curl", "-sS", f"http://127.0.0.1:{port}/v1/chat/completions",
            "-H", f"Authorization: Bearer {ADMIN_KEY}",
            "-H", "Content-Type: application/json",
            "-d", json.dumps(body),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["choices"][0]["message"]["content"], out
    assert out["model"] == MODEL


def test_trace_reads_a_session_of_the_service(svc, tmp_path):
    """`areal inf trace --service` finds the gateway, its admin key and the model's tokenizer
    in the service's state (docs/cli.md, `areal inf trace`); the session stays exportable."""
    a, port = svc
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}

    def post(path, body, headers=auth):
        req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    g = post("/rl/start_session", {"task_id": "trace", "group_size": 1})
    sess = g["sessions"][0]
    skey = {**auth, "Authorization": f"Bearer {sess['session_api_key']}"}
    msg = {"role": "user", "content": "trace me"}
    post("/v1/chat/completions", {"model": MODEL, "messages": [msg], "max_tokens": 4}, skey)
    post("/rl/set_reward", {"reward": 2.0}, skey)
    r = a("inf", "trace", "--service", "default", "--session", sess["session_id"], "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["source"]["service"] == "default" and doc["model"] == MODEL
    assert doc["tokenizer"] == {"path": str(PARROT), "decoded": True}
    [it] = doc["sessions"][0]["interactions"]
    assert it["reward"] == 2.0 and it["output_tokens"] > 0
    assert "trace me" in "".join(t["piece"] for t in it["tokens"] if not t["mask"])
    r = a("inf", "trace", "--session", sess["session_id"])  # the default service
    assert r.code == 0 and "reward 2 ·" in r.out, r.err
    r = a("inf", "trace", "--session", "sess-nope")
    assert r.code == 1 and r.err.startswith(
        "error: session 'sess-nope' not found on inf service 'default' ("
    ), r.err
    assert post("/rl/export_trajectories", {"session_ids": [sess["session_id"]]})["count"] == 1


def test_logs_of_every_component(svc):
    a, _ = svc
    for comp in ("gateway", "router", f"{MODEL}-worker-0", f"{MODEL}-data-proxy-0"):
        r = a("inf", "logs", "--service", "default", "--component", comp)
        assert r.code == 0 and r.out.strip(), comp
    r = a("inf", "logs", "--service", "default", "--component", "qwen-local-worker-9")
    assert r.code == 1
    assert (
        "available: gateway, qwen-local-data-proxy-0, qwen-local-worker-0, router, watchdog"
        in r.err
    )


def test_logs_follow(svc):
    a, _ = svc
    p = a.popen("inf", "logs", "--service", "default", "--component", "gateway", "-f")
    time.sleep(1.5)
    _, port = svc
    import urllib.request

    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0
    assert out.strip()


def test_deregister_then_register(svc):
    a, _ = svc
    r = a("inf", "deregister", "--service", "default", "--model-name", MODEL)
    assert r.code == 0, r.err
    assert a("inf", "models", "--service", "default", "--json").json()["models"] == []
    assert a.wait_status("running")["components"] == 3  # router, gateway, watchdog
    r = a(
        "inf", "register",
        "--service", "default",
        "--model-name", MODEL,
        "--backend", "sglang:d1",
        "--model-path", str(PARROT),
        "--tokenizer-path", str(PARROT),
        "--proxy-args", "--request-timeout 120 --chat-template-type hf",
    )  # fmt: skip
    assert r.code == 0, r.err
    m = a("inf", "models", "--service", "default", "--json").json()["models"][0]
    assert m["name"] == MODEL and m["registered"]


def test_sigkill_of_a_proxy_is_restarted_by_the_watchdog(svc):
    a, _ = svc
    name = f"{MODEL}-data-proxy-0"
    old = a("inf", "status", "--service", "default", "--json").json()["components"][name]
    os.kill(old["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    new = old
    while time.monotonic() < deadline:
        new = a("inf", "status", "--service", "default", "--json").json()["components"][name]
        if new["pid"] != old["pid"] and new["state"] == "running":
            break
        time.sleep(0.3)
    assert new["pid"] != old["pid"] and new["state"] == "running", new
    assert new["restarts"] == 1 and new["port"] == old["port"]  # same port: registration holds
    assert new["last_failure"]["reason"].startswith("process exited")
    a.wait_status("running")
    # The router takes the restarted proxy back at its next health poll (every second, and
    # its channel's reconnect backoff): the service serves again, not only its processes.
    port = svc[1]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 30
    code, out = _post(port, "/v1/chat/completions", ADMIN_KEY, chat)
    while code != 200 and time.monotonic() < deadline:
        assert code == 503 and out["error"]["code"] == "no_healthy_proxy", out
        time.sleep(0.2)
        code, out = _post(port, "/v1/chat/completions", ADMIN_KEY, chat)
    assert code == 200, out


def _post(port: int, path: str, key: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_session_key_survives_a_watchdog_restart_of_the_gateway(svc):
    """Session keys carry a MAC under the service's session-key secret: the gateway the
    watchdog restarts gets the same secret, so an existing session's key keeps working; a
    forged key (right shape, wrong MAC) is a 401 before and after."""
    from areal_cli.launcher import SESSION_KEY_SECRET_ENV
    from areal_runtime.session_keys import SECRET_ENV

    assert SESSION_KEY_SECRET_ENV == SECRET_ENV  # the CLI sets what the gateway reads
    a, port = svc
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    code, group = _post(port, "/rl/start_session", ADMIN_KEY, {"model": MODEL})
    assert code == 201, group
    key = group["sessions"][0]["session_api_key"]
    sid = group["sessions"][0]["session_id"]
    forged = key.rsplit(".", 1)[0] + "." + "A" * 22
    assert _post(port, "/v1/chat/completions", key, chat)[0] == 200
    assert _post(port, "/v1/chat/completions", forged, chat)[0] == 401

    old = a("inf", "status", "--service", "default", "--json").json()["components"]["gateway"]
    os.kill(old["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    new = old
    while time.monotonic() < deadline:
        new = a("inf", "status", "--service", "default", "--json").json()["components"]["gateway"]
        if new["pid"] != old["pid"] and new["state"] == "running":
            break
        time.sleep(0.3)
    assert new["pid"] != old["pid"] and new["state"] == "running", new
    assert new["port"] == old["port"] == port
    a.wait_status("running")

    code, out = _post(port, "/v1/chat/completions", key, chat)
    assert code == 200, out
    code, out = _post(port, "/rl/set_reward", key, {"reward": 1.0})
    assert code == 200 and out["session_id"] == sid, out
    code, out = _post(port, "/v1/chat/completions", forged, chat)
    assert code == 401 and out["error"]["type"] == "authentication_error", out
    code, out = _post(port, "/rl/export_trajectories", ADMIN_KEY, {"session_ids": [sid]})
    assert code == 200 and out["count"] == 2, out  # both chats, before and after the restart
    # The secret is in the secrets file only: not in the gateway's argv, the state or a log.
    secret = json.loads((a.home / "inf" / "services" / "default.secrets").read_text())[
        "session_key_secret"
    ]
    assert secret.encode() not in open(f"/proc/{new['pid']}/cmdline", "rb").read()
    assert secret not in (a.home / "inf" / "services" / "default.json").read_text()
    assert all(secret not in p.read_text(errors="replace") for p in a.home.rglob("*.log"))


def test_status_tells_when_the_watchdog_is_gone(svc):
    """kill -9 of the watchdog's whole process group (the watchdog and its guard): nothing
    supervises the service any more, and `status` says so in its header as in its table
    (it used to print "watchdog  on" over a table saying dead)."""
    a, _ = svc
    doc = a("inf", "status", "--service", "default", "--json").json()
    assert doc["supervision"]["enabled"] and doc["supervision"]["alive"] is True
    dog = doc["components"]["watchdog"]
    os.killpg(os.getpgid(dog["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = a("inf", "status", "--service", "default", "--json").json()
        if not doc["supervision"]["alive"]:
            break
        time.sleep(0.2)
    assert doc["supervision"]["alive"] is False
    assert doc["components"]["watchdog"]["state"] != "running"
    r = a("inf", "status", "--service", "default")
    assert r.code == 0, r.err
    assert "watchdog  dead" in r.out and "watchdog  on" not in r.out, r.out


def test_stop_and_force_stop(svc):
    a, _ = svc
    r = a("inf", "stop", "--service", "default")
    assert r.code == 0, r.err
    assert not a.wait_no_processes(5)
    assert a("inf", "ps", "--all", "--json").json() == []
    r = a("inf", "stop", "--service", "default", "--force")
    assert r.code == 1 and "no inf service named 'default'" in r.err
