"""The watchdog's decisions with stand-in processes (tests/fakes/fake_service.py, `sh`, `sleep`).

Restart on the recorded port, secrets re-read from the secrets file, exponential backoff,
bounded attempts then `failed` (the rest keeps running), hung detection (an injected probe,
and a SIGSTOPped stand-in gateway with the real probe), supervision off, config keys.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from areal_cli import config, lifecycle, supervisor
from areal_cli import state as st
from areal_cli.errors import CLIError
from areal_cli.supervisor import Component
from areal_cli.watchdog import SECRET_ENV, Policy, Watchdog, policy_from_config, sup_info, with_port

FAKE = Path(__file__).parent / "fakes" / "fake_service.py"
FAST = Policy(
    max_restarts=3, backoff_initial=0.05, backoff_max=0.4, check_interval=0.05, hung_after=2
)


@pytest.fixture
def svc(home, tmp_path):
    """Make components, record them as a running inf service 'svc'; kill all at the end."""
    made: list[Component] = []
    s = {
        "service": "svc",
        "instance": uuid.uuid4().hex,
        "phase": "running",
        "gateway": {"url": ""},
        "components": {},
        "supervision": FAST.to_dict(),
    }

    def add(name, role, argv, *, env=None, secret_env=(), wait_ready=None, **meta):
        proc, comp = supervisor.spawn(
            name,
            argv,
            tmp_path / f"{name}.log",
            env=env,
            meta={
                "role": role,
                "env": {k: v for k, v in (env or {}).items() if k not in SECRET_ENV},
                "secret_env": list(secret_env),
                **meta,
            },
        )
        if wait_ready:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                info = supervisor.read_ready_file(wait_ready)
                if info and info.get("pid") == proc.pid:
                    comp.port = info["port"]
                    comp.host = "127.0.0.1"
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(f"{name} not ready")
        made.append(comp)
        s["components"][name] = comp.to_dict()
        st.save("inf", "svc", s)
        return proc, comp

    add.state = s  # type: ignore[attr-defined]
    yield add
    final = st.load("inf", "svc") or s
    lifecycle.terminate_components(
        list(lifecycle.components(final).values()) + made, grace=0, force=True
    )


def comp(name: str) -> Component:
    s = st.load("inf", "svc")
    assert s is not None
    return Component.from_dict(s["components"][name])


def tick_until(wd: Watchdog, cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wd.tick()
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached; state: " + str(st.load("inf", "svc")))


def test_with_port_and_policy_checks():
    assert with_port(["x", "--port", "0", "--host", "h"], 8123) == [
        "x",
        "--port",
        "8123",
        "--host",
        "h",
    ]
    assert with_port(["x"], 1) == ["x"]
    with pytest.raises(CLIError):
        Policy(backoff_initial=2, backoff_max=1).check()
    with pytest.raises(CLIError):
        Policy(hung_after=0).check()


def test_supervision_config_keys(home, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[supervision]\nenabled = false\nmax_restarts = 2\nbackoff_max = 5\n")
    cfg = config.load("inf", f)
    p = policy_from_config(cfg, None)
    assert (p.enabled, p.max_restarts, p.backoff_max) == (False, 2, 5.0)
    assert policy_from_config(cfg, True).enabled  # the flag wins
    f.write_text('[supervision]\nenabled = "yes"\n')
    with pytest.raises(CLIError, match="must be bool"):
        config.load("agent", f)
    f.write_text("[supervision]\nbogus = 1\n")
    with pytest.raises(CLIError, match="unknown key 'bogus'"):
        config.load("inf", f)


def test_dead_component_restarts_on_its_port_with_secrets(svc, tmp_path):
    st.save_secrets("inf", "svc", {"internal_token": "tok-1", "admin_api_key": "adm"})
    ready = tmp_path / "router.ready"
    argv = [sys.executable, str(FAKE), "router", "--port", "0", "--ready-file", str(ready)]
    _, old = svc(
        "router",
        "router",
        argv,
        env={"AREAL_INTERNAL_TOKEN": "tok-1", "KEEP": "me"},
        secret_env=["AREAL_INTERNAL_TOKEN"],
        wait_ready=ready,
    )
    os.killpg(old.pgid, signal.SIGKILL)
    wd = Watchdog("inf", "svc", policy=FAST, log=lambda m: None)
    tick_until(
        wd,
        lambda: (
            sup_info(comp("router")).get("state") == "running" and comp("router").pid != old.pid
        ),
    )
    new = comp("router")
    info = sup_info(new)
    assert info["restarts"] == 1 and info["last_failure"]["reason"].startswith("process exited")
    assert new.alive() and new.port == old.port
    assert new.argv[new.argv.index("--port") + 1] == str(old.port)
    env = open(f"/proc/{new.pid}/environ", "rb").read().split(b"\0")
    assert b"AREAL_INTERNAL_TOKEN=tok-1" in env and b"KEEP=me" in env
    assert "tok-1" not in st.state_path("inf", "svc").read_text()  # secrets stay out of state
    assert lifecycle.status_doc("inf", "svc", probe=False)["components"]["router"]["restarts"] == 1


def test_backoff_bounded_attempts_then_failed_rest_stays(svc):
    svc("crasher", "proxy", ["sh", "-c", "exit 3"])
    _, steady = svc("steady", "engine", ["sleep", "60"])
    wd = Watchdog("inf", "svc", policy=FAST, log=lambda m: None)
    tick_until(wd, lambda: sup_info(comp("crasher")).get("state") == "failed")
    history = wd.tracks["crasher"].history
    assert len(history) == FAST.max_restarts
    # Doubling from 0.05 to the 0.4 cap: the delays themselves, not the restarts' wall times,
    # which count from each attempt's start and stretch with a loaded machine's spawns.
    assert wd.tracks["crasher"].backoff == min(
        FAST.backoff_max, FAST.backoff_initial * 2**FAST.max_restarts
    )
    assert history == sorted(history) and history[-1] - history[0] >= FAST.backoff_initial
    assert sup_info(comp("crasher"))["restarts"] == FAST.max_restarts
    # Failed: no more attempts; the rest of the service keeps running.
    for _ in range(10):
        wd.tick()
    assert sup_info(comp("crasher"))["restarts"] == FAST.max_restarts
    assert comp("steady").pid == steady.pid and steady.alive()
    s = st.load("inf", "svc")
    assert lifecycle.comp_state(comp("crasher")) == "failed"
    rows = lifecycle.ps_rows("inf", include_stale=True)
    assert rows[0]["failed"] == ["crasher"] and s is not None


def test_hung_component_is_killed_and_restarted(svc):
    _, old = svc("p", "proxy", ["sleep", "60"])
    answers = {"hung": False}

    def probe(c, s):
        return not (answers["hung"] and c.pid == old.pid)

    wd = Watchdog("inf", "svc", policy=FAST, probe=probe, log=lambda m: None)
    wd.tick()  # answers once: from now on it may be called hung
    answers["hung"] = True
    wd.tick()  # one miss is not enough (hung_after = 2)
    assert comp("p").pid == old.pid
    tick_until(wd, lambda: comp("p").pid != old.pid)
    assert sup_info(comp("p"))["last_failure"]["reason"].startswith("hung")
    assert not supervisor.group_alive(old)


def test_never_answered_is_still_starting_not_hung(svc):
    _, old = svc("e", "engine", ["sleep", "60"])
    wd = Watchdog("inf", "svc", policy=FAST, probe=lambda c, s: False, log=lambda m: None)
    for _ in range(20):
        wd.tick()
    assert comp("e").pid == old.pid and sup_info(comp("e")) == {}


def test_sigstopped_gateway_detected_with_real_probe(svc, tmp_path):
    st.save_secrets("inf", "svc", {"internal_token": "t", "admin_api_key": "k"})
    port = supervisor.free_port()
    ready = tmp_path / "gw.ready"
    argv = [sys.executable, str(FAKE), "gateway", "--port", str(port), "--ready-file", str(ready)]
    argv += ["--router-addr", "127.0.0.1:1"]
    _, old = svc(
        "gateway",
        "gateway",
        argv,
        env={"AREAL_INTERNAL_TOKEN": "t", "AREAL_ADMIN_API_KEY": "k"},
        secret_env=["AREAL_INTERNAL_TOKEN", "AREAL_ADMIN_API_KEY"],
        wait_ready=ready,
    )
    svc.state["gateway"]["url"] = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    st.save("inf", "svc", svc.state)  # type: ignore[attr-defined]
    policy = Policy(**{**FAST.to_dict(), "hung_after": 1})
    wd = Watchdog("inf", "svc", policy=policy, log=lambda m: None)
    wd.tick()
    assert wd.tracks["gateway"].answered
    os.kill(old.pid, signal.SIGSTOP)
    tick_until(
        wd,
        lambda: (
            comp("gateway").pid != old.pid and sup_info(comp("gateway")).get("state") == "running"
        ),
        timeout=30,
    )
    assert sup_info(comp("gateway"))["last_failure"]["reason"].startswith("hung")
    assert comp("gateway").port == port
    assert not supervisor.group_alive(old)


def test_supervision_off_restarts_nothing(svc):
    _, c = svc("x", "proxy", ["sh", "-c", "exit 1"])
    wd = Watchdog("inf", "svc", policy=Policy(enabled=False), log=lambda m: None)
    for _ in range(5):
        wd.tick()
    assert comp("x").pid == c.pid and sup_info(comp("x")) == {}


def test_watchdog_exits_when_service_stopped(svc):
    svc("y", "proxy", ["sleep", "60"])
    wd = Watchdog("inf", "svc", policy=FAST, log=lambda m: None)
    assert wd.tick()
    st.remove("inf", "svc")
    assert not wd.tick()


def _guards(home) -> list[int]:
    return supervisor.processes_with_env(
        f"AREAL_HOME={home}", cmdline=lambda argv: "areal_cli.guard" in argv
    )


def test_killed_watchdog_is_restarted_and_goes_on_supervising(fakes):
    """kill -9 of the watchdog: its guard starts it again; a proxy killed later comes back."""
    r = fakes.cli("inf", "run", "--port", "0", "--detach", "--model", "m", "--model-path", "x")
    assert r.code == 0, r.err
    try:
        s = st.load("inf", "default")
        wd_pid = s["components"]["watchdog"]["pid"]
        deadline = time.monotonic() + 10
        while not _guards(fakes.home) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _guards(fakes.home), "the watchdog started no guard"
        os.kill(wd_pid, signal.SIGKILL)

        def watchdog_back() -> dict | None:
            c = st.load("inf", "default")["components"]["watchdog"]
            return c if c["pid"] != wd_pid and Component.from_dict(c).alive() else None

        deadline = time.monotonic() + 15
        while not watchdog_back() and time.monotonic() < deadline:
            time.sleep(0.1)
        wd = watchdog_back()
        assert wd, "the killed watchdog was not restarted"
        sup = wd["meta"]["supervision"]
        assert sup["restarts"] == 1 and str(wd_pid) in sup["last_failure"]["reason"]

        proxy = st.load("inf", "default")["components"]["m-data-proxy-0"]
        os.kill(proxy["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = st.load("inf", "default")["components"]["m-data-proxy-0"]
            if now["pid"] != proxy["pid"] and Component.from_dict(now).alive():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the restarted watchdog did not restart the killed proxy")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = json.loads(fakes.cli("inf", "status", "--json").out)
            if status["status"] == "running":
                break
            time.sleep(0.2)
        assert status["status"] == "running", status
    finally:
        assert fakes.cli("inf", "stop").code == 0
    assert not fakes.kill_leftovers(), "stand-ins left after stop"
    deadline = time.monotonic() + 5
    while _guards(fakes.home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _guards(fakes.home), "a guard outlived stop"
