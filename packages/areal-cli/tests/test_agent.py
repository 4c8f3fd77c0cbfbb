"""`areal agent`: config schema and precedence, run with stand-in binaries, status JSON shape.

The stand-ins (tests/fakes/fake_service.py) follow docs/services.md; the fake agent
worker imports `--agent` like the real one (exit 2 with one line when it cannot).
The real binaries are exercised by tests/cli/test_agent_service.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_cli import config
from areal_cli import state as st
from areal_cli.agent import launch
from areal_cli.errors import CLIError

SPEC_EXAMPLE = """\
[default]
service = "default"
admin_api_key = "areal-agent-admin"
log_level = "info"

[run]
agent = "my_package.my_agent.MyAgent"
num_pairs = 2
setup_timeout = 120
health_poll_interval = 5
drain_timeout = 30
session_timeout = 1800
"""

AGENT = "my_package.my_agent.MyAgent"
FAKE = Path(__file__).parent / "fakes" / "fake_service.py"


# ---------------------------------------------------------------- config / resolve


def test_builtin_defaults(home):
    plan = launch.resolve(config.load("agent"), launch.RunOptions(agent="a.b.C"))
    assert (plan.service, plan.num_pairs, plan.log_level) == ("default", 1, "info")
    assert (plan.setup_timeout, plan.health_poll_interval) == (120, 5)
    assert (plan.drain_timeout, plan.session_timeout) == (30, 1800)
    assert (plan.host, plan.port, plan.inf) == ("127.0.0.1", 0, None)
    assert plan.key_source == "generated" and plan.admin_api_key.startswith("areal-agent-")


def test_spec_example_applies(home, tmp_path):
    f = tmp_path / "my-agent.toml"
    f.write_text(SPEC_EXAMPLE)
    plan = launch.resolve(config.load("agent", f), launch.RunOptions())
    assert plan.agent == AGENT and plan.num_pairs == 2
    assert plan.admin_api_key == "areal-agent-admin" and plan.key_source == "given"
    assert (plan.setup_timeout, plan.health_poll_interval, plan.drain_timeout) == (120, 5, 30)
    assert plan.session_timeout == 1800


def test_precedence_flag_over_config_over_default_file_over_builtin(home, tmp_path):
    (home / "agent").mkdir()
    (home / "agent" / "config.toml").write_text(
        '[default]\nservice = "from-home"\nlog_level = "warning"\n'
        '[run]\nagent = "home.mod.Agent"\nnum_pairs = 3\ndrain_timeout = 7\n'
    )
    extra = tmp_path / "extra.toml"
    extra.write_text('[run]\nagent = "extra.mod.Agent"\nnum_pairs = 4\n')
    cfg = config.load("agent", extra)
    plan = launch.resolve(cfg, launch.RunOptions())
    assert plan.agent == "extra.mod.Agent"  # --config over the default file
    assert plan.num_pairs == 4
    assert plan.service == "from-home" and plan.log_level == "warning"  # default file
    assert plan.drain_timeout == 7
    assert plan.session_timeout == 1800  # built-in
    plan = launch.resolve(cfg, launch.RunOptions(agent="flag.mod.Agent", num_pairs=5))
    assert (plan.agent, plan.num_pairs) == ("flag.mod.Agent", 5)  # flags win


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[run]\nagnet = "a.b.C"\n', "unknown key 'agnet' in [run]"),
        ('[runn]\nagent = "a.b.C"\n', "unknown table [runn]"),
        ("[run]\nnum_pairs = 'two'\n", "[run] key 'num_pairs' must be int"),
        ('[default]\nservice = "x"\ncolour = 1\n', "unknown key 'colour' in [default]"),
        ("[run\nagent = 1\n", "malformed TOML"),
    ],
)
def test_bad_config_names_file_and_key(home, tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(CLIError) as e:
        config.load("agent", f)
    assert str(f) in e.value.message and needle in e.value.message


def test_bad_default_file_is_an_error_too(home):
    (home / "agent").mkdir()
    (home / "agent" / "config.toml").write_text("[run]\nnum_pair = 2\n")
    with pytest.raises(CLIError, match=r"config.toml: unknown key 'num_pair' in \[run\]"):
        config.load("agent")


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({}, "--agent is required"),
        ({"agent": "nodots"}, "invalid --agent 'nodots'"),
        ({"agent": "a.b-c.D"}, "invalid --agent"),
        ({"agent": "a.B", "num_pairs": 0}, "--num-pairs must be at least 1"),
        ({"agent": "a.B", "setup_timeout": 0}, "--setup-timeout must be positive"),
        ({"agent": "a.B", "health_poll_interval": -1}, "--health-poll-interval must be positive"),
        ({"agent": "a.B", "drain_timeout": -1}, "--drain-timeout must not be negative"),
        ({"agent": "a.B", "log_level": "loud"}, "invalid --log-level 'loud'"),
        ({"agent": "a.B", "port": 70000}, "--port 70000 is out of range"),
        ({"agent": "a.B", "routing_strategy": "x"}, "invalid --routing-strategy 'x'"),
        ({"agent": "a.B", "inf_gateway_url": "http://127.0.0.1:1"}, "needs --inf-admin-api-key"),
        ({"agent": "a.B", "inf_model": "m"}, "need --inf-service or --inf-gateway-url"),
        (
            {"agent": "a.B", "inf_service": "x", "inf_gateway_url": "http://127.0.0.1:1"},
            "either --inf-service or --inf-gateway-url",
        ),
        ({"agent": "a.B", "inf_gateway_url": "ftp://x", "inf_admin_api_key": "k"}, "invalid"),
    ],
)
def test_usage_errors(home, opts, needle):
    with pytest.raises(CLIError) as e:
        launch.resolve(config.load("agent"), launch.RunOptions(**opts))
    assert needle in e.value.message and e.value.code == 2


def test_inf_gateway_url_link(home):
    plan = launch.resolve(
        config.load("agent"),
        launch.RunOptions(
            agent="a.B", inf_gateway_url="http://127.0.0.1:9/", inf_admin_api_key="k", inf_model="m"
        ),
    )
    assert plan.inf == launch.InfLink("http://127.0.0.1:9", "k", "m")


def test_inf_service_must_exist(home):
    with pytest.raises(CLIError, match="no inf service named 'nope'"):
        launch.resolve(config.load("agent"), launch.RunOptions(agent="a.B", inf_service="nope"))


def test_worker_env_puts_cwd_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"/x{os.pathsep}/here")
    env = launch.worker_env({"A": "1"}, "/here")
    assert env == {"A": "1", "PYTHONPATH": f"/here{os.pathsep}/x"}


# ---------------------------------------------------------------- CLI with stand-ins


@pytest.fixture
def agent(fakes, tmp_path):
    """Stand-ins in $AREAL_HOME/agent/config.toml and a project folder with my_package."""
    b = fakes.bin
    w = b / "fake-agent-worker"
    w.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" agent-worker "$@"\n')
    w.chmod(0o755)
    ap = b / "fake-agent-proxy"
    ap.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" agent-proxy "$@"\n')
    ap.chmod(0o755)
    (fakes.home / "agent").mkdir()
    (fakes.home / "agent" / "config.toml").write_text(
        "[binaries]\n"
        f'gateway = "{b}/fake-gateway"\n'
        f'router = "{b}/fake-router"\n'
        f'proxy = "{ap}"\n'
        f'agent_worker = "{w}"\n'
    )
    proj = tmp_path / "proj"
    (proj / "my_package").mkdir(parents=True)
    (proj / "my_package" / "__init__.py").write_text("")
    (proj / "my_package" / "my_agent.py").write_text(
        "class MyAgent:\n    async def run(self, request, *, emitter):\n        return 'hi'\n"
    )
    env = {k: v for k, v in fakes.env.items() if k != "PYTHONPATH"}
    yield AgentCLI(fakes, proj, env)
    left = fakes.kill_leftovers()
    assert not left, f"processes left behind: {left}"


class AgentCLI:
    """`areal agent ...` run from a project folder, with the stand-ins of `fakes`."""

    def __init__(self, fakes, cwd: Path, env: dict[str, str]) -> None:
        self.home, self.cwd, self.env = fakes.home, cwd, env
        self.pids, self.wait_gone = fakes.pids, fakes.wait_gone

    def __call__(self, *args: str, env: dict[str, str] | None = None):
        p = subprocess.run(
            [sys.executable, "-m", "areal_cli.main", "agent", *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=self.cwd,
            timeout=60,
        )
        return p

    def state(self, service: str = "default") -> dict | None:
        p = self.home / "agent" / "services" / f"{service}.json"
        return json.loads(p.read_text()) if p.exists() else None


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x]
    return {k.decode(): v.decode() for k, v in items}


def test_agent_is_required_exactly(agent):
    r = agent("run", "--service", "default")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --agent is required"
    assert agent.state() is None and not agent.pids()


def test_run_ps_status_logs_stop(agent):
    r = agent(
        "run", "--service", "default", "--agent", AGENT, "--num-pairs", "2",
        "--admin-api-key", "areal-agent-admin", "--health-poll-interval", "0.2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "agent service 'default' is running" in r.stdout

    # state: 0600, no secret, phase running, pairs recorded
    path = agent.home / "agent" / "services" / "default.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "areal-agent-admin" not in path.read_text()
    s = agent.state()
    assert s["phase"] == "running" and s["agent"] == AGENT and s["num_pairs"] == 2
    assert [p["worker"] for p in s["pairs"]] == ["worker-0", "worker-1"]
    secrets = st.secrets_path("agent", "default")
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert json.loads(secrets.read_text())["admin_api_key"] == "areal-agent-admin"
    comps = s["components"]
    assert set(comps) == {
        "router", "gateway", "worker-0", "worker-1", "proxy-0", "proxy-1", "watchdog",
    }  # fmt: skip
    gw_argv = comps["gateway"]["argv"]
    assert gw_argv[gw_argv.index("--mode") + 1] == "agent"
    assert gw_argv[gw_argv.index("--router-addr") + 1] == s["router"]["address"]
    assert "--drain-timeout" in comps["router"]["argv"]
    for i in (0, 1):
        w, p = comps[f"worker-{i}"], comps[f"proxy-{i}"]
        assert w["argv"][w["argv"].index("--agent") + 1] == AGENT
        # The agent worker's data proxy is its own binary, which has no --mode.
        assert p["argv"][0].endswith("fake-agent-proxy") and "--mode" not in p["argv"]
        worker_addr = p["argv"][p["argv"].index("--worker-addr") + 1]
        assert worker_addr == w["meta"]["address"]
        assert p["argv"][p["argv"].index("--session-timeout") + 1] == "1800"
        assert p["argv"][p["argv"].index("--proxy-id") + 1] == f"proxy-{i}"
        env = _environ(w["pid"])
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(agent.cwd)
        assert "areal-agent-admin" not in " ".join(w["argv"] + p["argv"] + gw_argv)

    # ps
    r = agent("ps")
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["SERVICE", "STATUS", "GATEWAY", "AGENT"]
    assert lines[1].split() == ["default", "running", s["gateway"]["url"], AGENT]
    rows = json.loads(agent("ps", "--json").stdout)
    assert rows[0]["agent"] == AGENT and rows[0]["status"] == "running"

    # status --json: .gateway.url and .pairs[].worker / .proxy objects
    doc = json.loads(agent("status", "--service", "default", "--json").stdout)
    assert doc["gateway"]["url"] == s["gateway"]["url"] and doc["gateway"]["healthy"]
    assert [p["worker"]["name"] for p in doc["pairs"]] == ["worker-0", "worker-1"]
    assert [p["proxy"]["name"] for p in doc["pairs"]] == ["proxy-0", "proxy-1"]
    assert all(p["worker"]["alive"] and p["proxy"]["alive"] for p in doc["pairs"])
    assert doc["router"]["alive"] and doc["agent"] == AGENT
    text = agent("status", "--service", "default").stdout
    assert "worker-1" in text and "proxy-1" in text and AGENT in text

    # logs
    for comp in ("gateway", "router", "worker-0", "proxy-1"):
        r = agent("logs", "--service", "default", "--component", comp)
        assert r.returncode == 0 and f"starting {comp}" in r.stdout
    r = agent("logs", "--service", "default", "--component", "worker-9")
    assert r.returncode == 1
    assert "available: gateway, proxy-0, proxy-1, router, watchdog, worker-0, worker-1" in r.stderr

    # a second run is refused
    r = agent("run", "--agent", AGENT)
    assert r.returncode == 1 and "already running" in r.stderr and "--force" in r.stderr

    r = agent("stop", "--service", "default")
    assert r.returncode == 0, r.stderr
    assert "7 components" in r.stdout
    assert not agent.wait_gone(5)
    assert agent.state() is None and not secrets.exists()


def test_bad_agent_fails_cleanly(agent):
    r = agent("run", "--agent", "my_package.missing.Nope")
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: worker-0 could not load the agent: areal-agent-worker: error:")
    assert "my_package.missing.Nope" in err
    assert "Traceback" not in r.stderr
    assert not agent.wait_gone(5)
    assert agent.state() is None
    assert not st.secrets_path("agent", "default").exists()


def test_agent_from_config_file(agent, tmp_path):
    f = tmp_path / "my-agent.toml"
    f.write_text(SPEC_EXAMPLE.replace("health_poll_interval = 5", "health_poll_interval = 0.2"))
    r = agent("--config", str(f), "run", "--service", "default")
    assert r.returncode == 0, r.stderr
    s = agent.state()
    assert s["agent"] == AGENT and len(s["pairs"]) == 2 and s["drain_timeout"] == 30
    assert agent("--config", str(f), "stop").returncode == 0


def test_force_over_stale_state_kills_recorded_orphans(agent):
    # Without the watchdog a dead gateway leaves stale state.
    assert agent("run", "--agent", AGENT, "--num-pairs", "2", "--no-supervise").returncode == 0
    s = agent.state()
    old = {n: c["pid"] for n, c in s["components"].items()}
    os.killpg(s["components"]["gateway"]["pgid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows = json.loads(agent("ps", "--all", "--json").stdout)
        if rows and rows[0]["status"] == "stale":
            break
        time.sleep(0.05)
    assert rows[0]["status"] == "stale"
    assert json.loads(agent("ps", "--json").stdout) == []
    r = agent("run", "--agent", AGENT)
    assert r.returncode == 1 and "stale" in r.stderr and "--force" in r.stderr
    r = agent("run", "--agent", AGENT, "--force")
    assert r.returncode == 0, r.stderr
    live = set(agent.pids())
    assert not live & set(old.values()), "recorded orphans of the stale state survived"
    assert len(agent.state()["pairs"]) == 1
    assert agent("stop", "--force").returncode == 0


def test_pair_registration_refused_cleans_up(agent):
    r = agent("run", "--agent", AGENT, env={"FAKE_REFUSE_PAIRS": "1"})
    assert r.returncode == 1
    assert "gateway refused to register pair proxy-0" in r.stderr
    assert not agent.wait_gone(5) and agent.state() is None


def test_unhealthy_pair_hits_setup_timeout(agent):
    t0 = time.monotonic()
    r = agent(
        "run", "--agent", AGENT, "--setup-timeout", "1.5", "--health-poll-interval", "0.3",
        env={"FAKE_PAIR_HEALTH": "unhealthy"},
    )  # fmt: skip
    assert r.returncode == 1
    assert "not healthy after --setup-timeout 1.5s" in r.stderr
    assert "proxy-0 unhealthy" in r.stderr
    assert time.monotonic() - t0 < 15
    assert not agent.wait_gone(5) and agent.state() is None


@pytest.mark.parametrize("role", ["router", "gateway", "agent-proxy", "agent-worker"])
def test_component_crash_at_launch_cleans_up(agent, role):
    r = agent("run", "--agent", AGENT, "--num-pairs", "2", env={"FAKE_CRASH": role})
    assert r.returncode == 1
    assert "failed to start" in r.stderr and "crashing as asked" in r.stderr
    assert not agent.wait_gone(5) and agent.state() is None


def test_stop_keep_state_then_stop(agent):
    assert agent("run", "--agent", AGENT).returncode == 0
    r = agent("stop", "--keep-state")
    assert r.returncode == 0 and "state kept" in r.stdout
    assert not agent.wait_gone(5)
    assert agent.state()["phase"] == "stopped"
    assert json.loads(agent("ps", "--all", "--json").stdout)[0]["status"] == "stopped"
    assert agent("stop").returncode == 0 and agent.state() is None


def test_force_over_kept_state_keeps_the_admin_key(agent, home):
    """Clients hold the generated key: replacing a stopped-but-kept service must not change it."""
    assert agent("run", "--agent", AGENT).returncode == 0
    key = st.load_secrets("agent", "default")["admin_api_key"]
    assert key.startswith("areal-agent-")
    assert agent("stop", "--keep-state").returncode == 0
    r = agent("run", "--agent", AGENT, "--force")
    assert r.returncode == 0, r.stderr
    assert "kept from the replaced service" in r.stdout
    assert st.load_secrets("agent", "default")["admin_api_key"] == key
    assert agent("stop").returncode == 0
    # With nothing recorded a new key is made; a given key always wins.
    assert agent("run", "--agent", AGENT, "--force").returncode == 0
    assert st.load_secrets("agent", "default")["admin_api_key"] != key
    assert agent("stop", "--keep-state").returncode == 0
    assert agent("run", "--agent", AGENT, "--force", "--admin-api-key", "given-key").returncode == 0
    assert st.load_secrets("agent", "default")["admin_api_key"] == "given-key"
    assert agent("stop").returncode == 0


def test_link_to_inf_service(agent, fakes):
    r = fakes.cli("inf", "run", "--service", "llm", "--port", "0", "--admin-api-key", "inf-key",
                  "--detach")  # fmt: skip
    assert r.code == 0, r.err
    try:
        inf_url = json.loads(fakes.cli("inf", "status", "--service", "llm", "--json").out)[
            "gateway"
        ]["url"]
        r = agent("run", "--agent", AGENT, "--inf-service", "llm", "--inf-model", "m1")
        assert r.returncode == 0, r.stderr
        s = agent.state()
        argv = s["components"]["proxy-0"]["argv"]
        assert argv[argv.index("--inf-gateway-url") + 1] == inf_url
        assert argv[argv.index("--inf-model") + 1] == "m1"
        assert "inf-key" not in json.dumps(s)
        env = _environ(s["components"]["proxy-0"]["pid"])
        assert env["AREAL_PROXY_INF_ADMIN_API_KEY"] == "inf-key"
        assert s["inf_link"] == {"service": "llm", "gateway_url": inf_url, "model": "m1"}
        assert agent("stop").returncode == 0
    finally:
        fakes.cli("inf", "stop", "--service", "llm", "--force")


def test_link_to_dead_inf_gateway_fails_before_starting(agent):
    r = agent(
        "run", "--agent", AGENT, "--inf-gateway-url", "http://127.0.0.1:9",
        "--inf-admin-api-key", "k",
    )  # fmt: skip
    assert r.returncode == 1 and "does not answer" in r.stderr
    assert agent.state() is None and not agent.pids()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_stops_everything(agent, sig):
    p = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.main", "agent", "run", "--agent", AGENT,
         "--num-pairs", "2", "--health-poll-interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**agent.env, "FAKE_PAIR_HEALTH": "unhealthy"},
        cwd=agent.cwd,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = agent.state()
        if s and len(s["pairs"]) == 2 and all(x.get("registered") for x in s["pairs"]):
            break
        time.sleep(0.05)
    assert len(agent.pids()) == 6
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "everything it started was stopped" in err
    assert not agent.wait_gone(5) and agent.state() is None
