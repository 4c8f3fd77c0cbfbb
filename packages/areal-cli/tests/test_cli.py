"""The `areal` command end to end with stand-in binaries (tests/fakes/fake_service.py).

The real binaries are exercised by tests/cli; here the CLI's own logic is tested:
assembly order, state, secrets, failure cleanup, foreground teardown, races.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from areal_cli import state as st
from areal_cli import supervisor


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean(fakes):
    yield fakes
    left = fakes.kill_leftovers()
    assert not left, f"processes left behind: {left}"


MODEL = ("--model", "m", "--model-path", "x")


def _run_detached(f, *args: str, env: dict[str, str] | None = None):
    """`areal inf run --port <a free port> --detach ARGS`."""
    return f.cli("inf", "run", "--port", str(_port()), "--detach", *args, env=env)


def _wait_running(f, service="default", timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = f.cli("inf", "ps", "--json")
        rows = [x for x in json.loads(r.out or "[]") if x["service"] == service]
        if rows and rows[0]["status"] == "running":
            return rows[0]
        time.sleep(0.1)
    raise AssertionError("service did not become running")


def test_everything_under_areal_home_is_private(clean, tmp_path):
    """0600 files in 0700 folders, AREAL_HOME itself included, even for files a service makes."""
    f = clean
    home = tmp_path / "fresh" / "areal-home"  # AREAL_HOME does not exist yet
    env = {"AREAL_HOME": str(home)}
    f.home = home
    config = ("--config", str(tmp_path / "home" / "inf" / "config.toml"))  # the stand-ins
    try:
        r = f.cli("inf", *config, "run", "--port", str(_port()), "--detach", *MODEL, env=env)
        assert r.code == 0, r.err
        paths = [home, *home.rglob("*")]
        assert any(p.name.endswith(".sqlite-wal") for p in paths), "the stand-in proxy made no db"
        wrong = [
            f"{p.relative_to(home.parent)} {stat.S_IMODE(p.stat().st_mode):o}"
            for p in paths
            if stat.S_IMODE(p.stat().st_mode) != (0o700 if p.is_dir() else 0o600)
        ]
        assert not wrong, wrong
    finally:
        assert f.cli("inf", "stop", env=env).code == 0


def test_help_and_version(fakes):
    r = fakes.cli("--help")
    assert r.code == 0 and "inf" in r.out and "train" in r.out
    for cmd in ("run", "register", "deregister", "models", "ps", "status", "logs", "stop"):
        r = fakes.cli("inf", cmd, "--help")
        assert r.code == 0, (cmd, r.err)
    assert "Return once every component is healthy" in fakes.cli("inf", "run", "--help").out
    assert fakes.cli("--version").out.startswith("areal ")


def test_startup_imports_nothing_heavy():
    code = (
        "import sys; import areal_cli.main; "
        "bad = [m for m in ('pydantic', 'rich', 'httpx', 'urllib.request', 'http.client', "
        "'tomllib', 'areal_cli.inf.launch', 'areal_cli.lifecycle') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_errors_are_one_line_without_traceback(fakes):
    r = fakes.cli("inf", "status", "--service", "nope")
    assert r.code == 1
    assert r.err.startswith("error: no inf service named 'nope'")
    assert r.err.count("\n") == 1 and "Traceback" not in r.err
    r = fakes.cli("inf", "run", "--backend", "sglang:d1")
    assert r.code == 2 and "model registration flags require --model." in r.err
    r = fakes.cli("inf", "stop", "--service", "../x")
    assert r.code == 2 and r.err.count("\n") == 1


def test_full_lifecycle_detached(clean):
    f = clean
    port = _port()
    t0 = time.monotonic()
    r = f.cli(
        "inf",
        "run",
        "--service",
        "default",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-api-key",
        "areal-admin-key",
        "--scheduler",
        "local",
        "--detach",
        "--model",
        "m1",
        "--backend",
        "sglang:d2",
        "--model-path",
        "models/tiny-parrot",
        "--proxy-args",
        "--request-timeout 120 --chat-template-type hf",
    )
    assert r.code == 0, r.err
    assert time.monotonic() - t0 < 20
    s = st.load("inf", "default")
    assert s["phase"] == "running" and s["scheduler"] == "local"
    assert set(s["components"]) == {
        "gateway",
        "router",
        "m1-worker-0",
        "m1-worker-1",
        "m1-data-proxy-0",
        "m1-data-proxy-1",
        "watchdog",
    }
    for c in s["components"].values():
        assert {"pid", "pgid", "start_time", "argv", "host", "port", "log"} <= set(c)
        assert c["pid"] == c["pgid"]
        assert os.path.isfile(c["log"])
        assert "areal-admin-key" not in " ".join(c["argv"])
    text = st.state_path("inf", "default").read_text()
    assert "areal-admin-key" not in text and "internal_token" not in text
    assert stat.S_IMODE(st.secrets_path("inf", "default").stat().st_mode) == 0o600
    proxy_argv = s["components"]["m1-data-proxy-1"]["argv"]
    assert proxy_argv[-4:] == ["--request-timeout", "120", "--chat-template-type", "hf"]
    assert "--proxy-id" in proxy_argv and "m1-data-proxy-1" in proxy_argv
    # Migration: a proxy asks the router (the gateway's address of it) for its peers.
    assert proxy_argv[proxy_argv.index("--router-addr") + 1] == s["router"]["address"]
    engine_argv = s["components"]["m1-worker-0"]["argv"]
    assert "--device" in engine_argv and "cpu" in engine_argv  # SGLANG_CPU_ARGS: no GPU here
    gw_argv = s["components"]["gateway"]["argv"]
    assert gw_argv[gw_argv.index("--router-addr") + 1] == s["router"]["address"]

    row = _wait_running(f)
    assert row["gateway"] == f"http://127.0.0.1:{port}" and row["models"] == ["m1"]
    doc = json.loads(f.cli("inf", "status", "--service", "default", "--json").out)
    assert doc["gateway"]["url"] == f"http://127.0.0.1:{port}" and doc["gateway"]["healthy"]
    comps = doc["components"]
    assert comps["gateway"]["metrics_url"] == f"http://127.0.0.1:{port}/metrics"
    assert comps["m1-worker-0"]["metrics_url"] is None and "metrics_url" in comps["router"]
    assert len(doc["models"][0]["replicas"]) == 2
    # Which tool-call / reasoning parser each replica has in force, and whether
    # its proxy writes `tools` into the prompt: from the gateway's /admin/workers.
    (rep0, _) = doc["models"][0]["replicas"]
    parsing = {k: rep0[k] for k in ("tool_call_parser", "reasoning_parser", "default_tool_prompt")}
    assert parsing == {
        "tool_call_parser": "hermes",
        "reasoning_parser": "",
        "default_tool_prompt": True,
    }
    out = f.cli("inf", "status", "--service", "default").out
    table = out.split("TOOL-CALL PARSER  REASONING PARSER  DEFAULT TOOL PROMPT\n", 1)[1]
    row = next(line for line in table.splitlines() if line.startswith("m1-data-proxy-0 "))
    assert row.split() == ["m1-data-proxy-0", "m1", "hermes", "none", "yes"]
    models = json.loads(f.cli("inf", "models", "--service", "default", "--json").out)["models"]
    assert models[0]["name"] == "m1" and models[0]["registered"] and len(models[0]["workers"]) == 2
    assert "m1" in f.cli("inf", "models", "--service", "default").out

    r = f.cli(
        "inf",
        "register",
        "--service",
        "default",
        "--model-name",
        "m2",
        "--backend",
        "sglang:d1",
        "--model-path",
        "models/tiny-parrot",
    )
    assert r.code == 0, r.err
    assert "m2-data-proxy-0" in st.load("inf", "default")["components"]
    r = f.cli("inf", "register", "--model-name", "m2", "--model-path", "x")
    assert r.code == 1 and "already registered" in r.err

    r = f.cli("inf", "logs", "--service", "default", "--component", "gateway", "-n", "100")
    assert r.code == 0 and "gateway listening" in r.out
    r = f.cli("inf", "logs", "--service", "default", "--component", "nope")
    assert r.code == 1 and "available: gateway, m1-data-proxy-0" in r.err

    # Scale-down: replica 1 of m1 is drained (the gateway retires its proxy), its engine
    # stopped; its proxy stays, to be restarted retired.
    before = st.load("inf", "default")["components"]
    r = f.cli("inf", "deregister", "--model-name", "m1", "--replica", "1", "--drain-timeout", "0")
    assert r.code == 0, r.err
    assert "2 request(s) finished on its engine, 1 moved" in r.out
    s = st.load("inf", "default")
    assert "m1-worker-1" not in s["components"] and "m1-worker-0" in s["components"]
    assert s["components"]["m1-data-proxy-1"]["argv"][-1] == "--retired"
    assert not supervisor.group_alive(supervisor.Component.from_dict(before["m1-worker-1"]))
    assert supervisor.Component.from_dict(s["components"]["m1-data-proxy-1"]).alive()
    (m1,) = [
        m for m in json.loads(f.cli("inf", "models", "--json").out)["models"] if m["name"] == "m1"
    ]
    assert [r["retired"] for r in m1["replicas"]] == [False, True]
    r = f.cli("inf", "deregister", "--model-name", "m1", "--replica", "1")
    assert r.code == 0 and "already retired" in r.out
    r = f.cli("inf", "deregister", "--model-name", "m1", "--replica", "0")
    assert r.code == 1 and "last serving replica" in r.err and "--model-name m1" in r.err
    r = f.cli("inf", "deregister", "--model-name", "m1", "--replica", "7")
    assert r.code == 2 and "no replica 7 (replicas: 0, 1)" in r.err
    r = f.cli("inf", "deregister", "--model-name", "m1", "--replica", "0", "--drain-timeout", "-1")
    assert r.code == 2
    assert "m1-worker-0" in st.load("inf", "default")["components"]

    r = f.cli("inf", "deregister", "--service", "default", "--model-name", "m2")
    assert r.code == 0, r.err
    s = st.load("inf", "default")
    assert "m2" not in s["models"] and "m2-worker-0" not in s["components"]
    names = [m["name"] for m in json.loads(f.cli("inf", "models", "--json").out)["models"]]
    assert names == ["m1"]
    r = f.cli("inf", "deregister", "--model-name", "m2")
    assert r.code == 1 and "not registered" in r.err

    r = _run_detached(f)
    assert r.code == 1 and "already running" in r.err

    t0 = time.monotonic()
    r = f.cli("inf", "stop", "--service", "default")
    assert r.code == 0, r.err
    assert time.monotonic() - t0 < 5
    assert st.load("inf", "default") is None
    assert not f.wait_gone(2)
    assert f.cli("inf", "ps", "--all", "--json").out.strip() == "[]"


def test_config_file_values_apply(clean, tmp_path):
    f = clean
    port = _port()
    extra = tmp_path / "inf.toml"
    extra.write_text(
        f'[default]\nservice = "cfgsvc"\n[launch]\ngateway_port = {port}\n'
        'routing_strategy = "least_loaded"\n'
        '[register.internal]\nbackend = "sglang:d1"\nmodel_path = "models/tiny-parrot"\n'
        'proxy_args = "--chat-template-type concat"\n'
    )
    r = f.cli("inf", "--config", str(extra), "run", "--detach", "--model", "mc")
    assert r.code == 0, r.err
    s = st.load("inf", "cfgsvc")
    assert s["gateway"]["port"] == port
    router_argv = s["components"]["router"]["argv"]
    assert router_argv[router_argv.index("--policy") + 1] == "least_loaded"
    assert s["components"]["mc-data-proxy-0"]["argv"][-2:] == ["--chat-template-type", "concat"]
    assert f.cli("inf", "--config", str(extra), "stop").code == 0


def test_admission_bounds_from_flags_and_toml_reach_the_gateway_and_status(clean, tmp_path):
    f = clean
    extra = tmp_path / "inf.toml"
    extra.write_text("[register.internal]\nmax_staleness = 1\nbatch_size = 8\n")
    r = f.cli(
        "inf",
        "--config",
        str(extra),
        "run",
        "--port",
        str(_port()),
        "--detach",
        *MODEL,
        "--max-concurrent-rollouts",
        "4",
    )
    assert r.code == 0, r.err
    doc = json.loads(f.cli("inf", "status", "--json").out)
    (model,) = doc["models"]
    adm = model["admission"]
    assert (adm["max_staleness"], adm["batch_size"], adm["max_concurrent_rollouts"]) == (1, 8, 4)
    text = f.cli("inf", "status").out
    assert "CAPACITY LEFT" in text and "max_concurrent_rollouts=4" in text
    assert f.cli("inf", "stop").code == 0
    # Half a staleness bound is a usage error before anything starts.
    r = f.cli("inf", "run", "--port", str(_port()), "--detach", *MODEL, "--max-staleness", "1")
    assert r.code == 2 and "--max-staleness and --batch-size go together" in r.err
    assert st.load("inf", "default") is None


def test_foreground_ctrl_c_and_sigterm_tear_down(clean):
    f = clean
    for sig in (signal.SIGINT, signal.SIGTERM):
        p = f.popen("inf", "run", "--port", str(_port()), "--admin-api-key", "k")
        _wait_running(f)
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert st.load("inf", "default") is None
        assert not f.wait_gone(2)


def test_foreground_component_death_tears_down(clean):
    f = clean
    p = f.popen(
        "inf", "run", "--port", str(_port()), "--model", "m", "--model-path", "x", "--no-supervise"
    )
    _wait_running(f)
    pid = st.load("inf", "default")["components"]["m-worker-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1
    assert "m-worker-0 died" in err and "service torn down" in err
    assert st.load("inf", "default") is None
    assert not f.wait_gone(2)


def test_stop_from_elsewhere_ends_foreground(clean):
    f = clean
    p = f.popen("inf", "run", "--port", str(_port()))
    _wait_running(f)
    assert f.cli("inf", "stop").code == 0
    p.communicate(timeout=30)
    assert p.returncode == 0


def test_sigkill_component_shows_degraded(clean):
    f = clean
    assert _run_detached(f, *MODEL, "--no-supervise").code == 0
    os.kill(st.load("inf", "default")["components"]["m-data-proxy-0"]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    rows = json.loads(f.cli("inf", "ps", "--json").out)
    assert rows[0]["status"] == "degraded" and rows[0]["dead"] == ["m-data-proxy-0"]
    assert "degraded" in f.cli("inf", "ps").out
    assert f.cli("inf", "stop", "--force").code == 0


def test_killed_foreground_cli_then_force_kills_orphans(clean):
    f = clean
    p = f.popen("inf", "run", "--port", str(_port()))
    _wait_running(f)
    old = st.load("inf", "default")["components"]
    p.kill()
    p.communicate()
    assert len(f.pids()) == 2  # orphans, still recorded
    r = _run_detached(f)
    assert r.code == 1 and "--force" in r.err
    r = _run_detached(f, "--force")
    assert r.code == 0, r.err
    for c in old.values():
        assert not os.path.exists(f"/proc/{c['pid']}") or c["pid"] not in f.pids()
    assert f.cli("inf", "stop").code == 0


def test_stale_state_shown_by_ps_all_and_cleaned_by_stop(clean):
    f = clean
    assert _run_detached(f, "--no-supervise").code == 0
    os.kill(st.load("inf", "default")["components"]["gateway"]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    assert json.loads(f.cli("inf", "ps", "--json").out) == []
    assert json.loads(f.cli("inf", "ps", "--all", "--json").out)[0]["status"] == "stale"
    assert f.cli("inf", "stop").code == 0
    assert st.load("inf", "default") is None


def test_two_concurrent_runs_one_wins(clean):
    f = clean
    ports = [_port(), _port()]
    procs = [f.popen("inf", "run", "--port", str(p), "--detach") for p in ports]
    results = [(*p.communicate(timeout=60), p.returncode) for p in procs]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 1], results
    loser = next(r for r in results if r[2] == 1)
    assert "busy" in loser[1] or "already running" in loser[1]
    assert f.cli("inf", "stop").code == 0


def test_port_in_use_fails_before_starting_anything(clean):
    f = clean
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = f.cli("inf", "run", "--port", str(s.getsockname()[1]), "--detach")
    assert r.code == 1 and "already in use" in r.err
    assert st.load("inf", "default") is None


def test_missing_binary_on_path(clean, tmp_path):
    f = clean
    (f.home / "inf" / "config.toml").unlink()
    r = _run_detached(f, env={"PATH": str(tmp_path)})
    assert r.code == 1 and "areal-router not found on PATH" in r.err
    assert st.load("inf", "default") is None


@pytest.mark.parametrize("role", ["router", "gateway", "proxy"])
def test_component_crash_at_launch_cleans_up(clean, role):
    f = clean
    r = _run_detached(f, *MODEL, env={"FAKE_CRASH": role})
    assert r.code == 1
    assert "failed to start: process exited (code 3)" in r.err
    assert "crashing as asked" in r.err and "log: " in r.err
    assert st.load("inf", "default") is None
    assert not f.wait_gone(3)


def test_engine_crash_via_bad_engine_args(clean):
    f = clean
    r = _run_detached(f, *MODEL, "--engine-args", "--no-such-flag 1")
    assert r.code == 1
    assert "m-worker-0 failed to start" in r.err and "unrecognized arguments" in r.err
    assert "m-worker-0.log" in r.err
    assert st.load("inf", "default") is None


def test_engine_args_replace_the_cpu_defaults_of_the_same_name(clean):
    """--engine-args is forwarded verbatim: a flag given there is not also passed with its CPU
    default (each flag once, the user's value); defaults the user did not give stay."""
    f = clean
    user = "--mem-fraction-static 0.8 --max-total-tokens=2048 --disable-overlap-schedule"
    assert _run_detached(f, "--no-supervise", *MODEL, "--engine-args", user).code == 0
    argv = st.load("inf", "default")["components"]["m-worker-0"]["argv"]
    flags = [t.split("=", 1)[0] for t in argv if t.startswith("--")]
    assert len(flags) == len(set(flags)), argv
    assert argv[-4:] == user.split()
    assert argv[argv.index("--device") + 1] == "cpu"  # a default not given: kept
    assert "0.05" not in argv and "4096" not in argv  # the replaced defaults' values
    assert f.cli("inf", "stop").code == 0


@pytest.mark.parametrize(
    ("user", "flag"),
    [
        ("--port 9999", "--port"),
        ("--host=0.0.0.0", "--host"),
        ("--served-model-name x", "--served-model-name"),
    ],
)
def test_engine_args_that_areal_sets_itself_are_refused_before_anything_starts(clean, user, flag):
    f = clean
    r = _run_detached(f, *MODEL, "--engine-args", user)
    assert r.code == 2, r.err
    assert f"--engine-args gives {flag}" in r.err and "Traceback" not in r.err
    assert st.load("inf", "default") is None
    assert not f.wait_gone(3)


def test_register_failure_keeps_service(clean):
    f = clean
    assert _run_detached(f).code == 0
    r = f.cli(
        "inf", "register", "--model-name", "bad", "--model-path", "x", "--engine-args", "--nope"
    )
    assert r.code == 1 and "bad-worker-0 failed to start" in r.err
    s = st.load("inf", "default")
    assert set(s["components"]) == {"gateway", "router", "watchdog"} and s["models"] == {}
    assert json.loads(f.cli("inf", "ps", "--json").out)[0]["status"] == "running"
    assert f.cli("inf", "stop").code == 0


def test_engine_health_timeout(clean):
    f = clean
    r = _run_detached(f, *MODEL, "--model-health-timeout", "0.5", env={"FAKE_ENGINE_DELAY": "30"})
    assert r.code == 1 and "not healthy after 0.5s" in r.err
    assert st.load("inf", "default") is None


def test_gpu_allocation_through_cli(clean):
    f = clean
    gpu_model = ("--model", "g", "--model-path", "x")
    r = _run_detached(
        f, *gpu_model, "--backend", "sglang:d2t2", env={"CUDA_VISIBLE_DEVICES": "0,1,2"}
    )
    assert r.code == 1 and "needs 4 GPUs" in r.err
    r = _run_detached(f, *gpu_model, "--backend", "sglang:d2", env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert r.code == 0, r.err
    s = st.load("inf", "default")
    assert [rep["gpus"] for rep in s["models"]["g"]["replicas"]] == [[3], [5]]
    engine_argv = s["components"]["g-worker-0"]["argv"]
    assert "cpu" not in engine_argv  # on GPUs the CPU defaults are not added
    r = f.cli(
        "inf",
        "register",
        "--model-name",
        "h",
        "--model-path",
        "x",
        env={"CUDA_VISIBLE_DEVICES": "3,5"},
    )
    assert r.code == 1 and "only 0 of 2 visible are free" in r.err
    assert f.cli("inf", "stop").code == 0


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok", "pid": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_a_port_served_by_someone_else_is_not_our_gateway():
    from areal_cli.http import gateway_healthy

    srv = HTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert not gateway_healthy(url, os.getpid())
        assert gateway_healthy(url, 1)
    finally:
        srv.shutdown()


@pytest.mark.parametrize("group", ["inf", "agent"])
def test_blank_service_and_negative_grace_are_refused_alike(fakes, group):
    # `--service "$SVC"` with SVC unset must not quietly act on the default service.
    for argv in (
        ("status", "--service", ""),
        ("logs", "--service", " ", "--component", "gateway"),
        ("stop", "--service", ""),
        ("stop", "--grace-period", "-1"),
        ("stop", "--grace", "-1"),
    ):
        r = fakes.cli(group, *argv)
        assert r.code == 2, (argv, r.out, r.err)
        assert "Traceback" not in r.err
        assert "--service" in r.err or "--grace-period" in r.err, r.err


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in raw if e)


def test_session_key_secret_only_to_the_gateway_and_kept_across_its_restart(clean):
    """The gateway signs session keys with AREAL_SESSION_KEY_SECRET: generated at `run`,
    kept in the 0600 secrets file only, given to the gateway alone, and given again to the
    gateway the watchdog restarts (so the keys its predecessor minted keep working)."""
    f = clean
    r = _run_detached(f)
    assert r.code == 0, r.err
    try:
        secret = st.load_secrets("inf", "default")["session_key_secret"]
        assert len(secret) >= 32
        s = st.load("inf", "default")
        assert secret not in st.state_path("inf", "default").read_text()
        comps = s["components"]
        old = comps["gateway"]
        assert "AREAL_SESSION_KEY_SECRET" in old["meta"]["secret_env"]
        assert _environ(old["pid"])["AREAL_SESSION_KEY_SECRET"] == secret
        for name in set(comps) - {"gateway"}:  # the router and the watchdog
            env = _environ(comps[name]["pid"])
            assert "AREAL_SESSION_KEY_SECRET" not in env and secret not in env.values(), name
        os.kill(old["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        new = old
        while time.monotonic() < deadline:
            new = st.load("inf", "default")["components"]["gateway"]
            if new["pid"] != old["pid"] and _wait_alive(new["pid"]):
                break
            time.sleep(0.2)
        assert new["pid"] != old["pid"], "the watchdog did not restart the gateway"
        assert _environ(new["pid"])["AREAL_SESSION_KEY_SECRET"] == secret
    finally:
        # Also when an assertion failed: the watchdog would restart what the fixture kills.
        assert f.cli("inf", "stop", "--force").code == 0


def _wait_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
