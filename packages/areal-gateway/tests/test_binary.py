"""The `areal-gateway` program as a subprocess: flags, ready file, refusals, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN_KEY, Stack, wait_until
from fakes import TOKEN

import areal_gateway

MESSAGES = [{"role": "user", "content": "hi"}]


def command() -> list[str]:
    exe = shutil.which("areal-gateway", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "areal_gateway"]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    e.update(AREAL_ADMIN_API_KEY=ADMIN_KEY, AREAL_INTERNAL_TOKEN=TOKEN)
    e.update(extra)
    return e


def run(args: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command() + args, capture_output=True, text=True, timeout=30, **kw)


def start(
    args: list[str], ready: Path, environ: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(
        [*command(), *args, "--ready-file", str(ready)],
        env=environ or env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ok = wait_until(lambda: ready.exists() or proc.poll() is not None, 20)
    if not ok or proc.poll() is not None:
        _out, err = proc.communicate(timeout=5)
        raise AssertionError(f"gateway did not start: rc={proc.returncode}\n{err}")
    return proc, json.loads(ready.read_text())


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_version() -> None:
    r = run(["--version"])
    assert r.returncode == 0 and areal_gateway.__version__ in r.stdout


def test_help_names_every_environment_variable_it_reads() -> None:
    r = run(["--help"])
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for name in (
        "AREAL_ADMIN_API_KEY",
        "AREAL_INTERNAL_TOKEN",
        "AREAL_SESSION_KEY_SECRET",
        "AREAL_TLS_CA",
        "AREAL_TLS_CERT",
        "AREAL_TLS_KEY",
        "OTEL_",
        "AREAL_GATEWAY_ROUTER_ADDR",
    ):
        assert name in text, name


def test_refuses_default_key_beyond_loopback() -> None:
    r = run(
        ["--router-addr", "127.0.0.1:1", "--host", "0.0.0.0"],
        env=env(AREAL_ADMIN_API_KEY="areal-admin-key"),
    )
    assert r.returncode == 2
    assert "default admin key" in r.stderr and "AREAL_ADMIN_API_KEY" in r.stderr


def test_requires_admin_key_and_router_addr() -> None:
    e = env()
    del e["AREAL_ADMIN_API_KEY"]
    r = run(["--router-addr", "127.0.0.1:1"], env=e)
    assert r.returncode == 2 and "AREAL_ADMIN_API_KEY" in r.stderr
    r = run([], env=env())
    assert r.returncode == 2 and "--router-addr" in r.stderr


def test_bad_flag_values_are_refused() -> None:
    r = run(["--router-addr", "127.0.0.1:1", "--mode", "nope"], env=env())
    assert r.returncode == 2
    r = run(["--router-addr", "127.0.0.1:1", "--port", "abc"], env=env())
    assert r.returncode == 2


def test_ready_file_health_and_sigterm_drains(stack: Stack, tmp_path: Path) -> None:
    stack.register("m-bin")
    ready = tmp_path / "gw.json"
    # --no-proxy-streams: the stack's fake proxies answer the per-call RPCs only.
    args = ["--router-addr", stack.router_addr, "--port", "0", "--drain-timeout", "5"]
    proc, info = start([*args, "--no-proxy-streams"], ready)
    try:
        assert stat.S_IMODE(ready.stat().st_mode) == 0o600
        assert info["pid"] == proc.pid and info["host"] == "127.0.0.1" and info["port"] > 0
        assert info["version"] == areal_gateway.__version__ and "started_at" in info
        url = f"http://127.0.0.1:{info['port']}"
        health = httpx.get(url + "/health").json()
        assert health["pid"] == proc.pid and health["instance"] == info["instance"]
        assert ADMIN_KEY not in proc.args and TOKEN not in " ".join(proc.args)

        # A slow stream is in flight when SIGTERM arrives: it must complete.
        result: dict = {}

        def slow() -> None:
            with httpx.Client(base_url=url, timeout=20) as c:
                r = c.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    json={
                        "model": "m-bin",
                        "messages": MESSAGES,
                        "stream": True,
                        "fake": {"chunks": 6, "delay": 0.2},
                    },
                )
                result["status"] = r.status_code
                result["text"] = r.text

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        t.join(15)
        assert result.get("status") == 200
        assert result["text"].count("data: ") == 7 and result["text"].endswith("data: [DONE]\n\n")
        assert proc.wait(15) == 0
        _, err = proc.communicate(timeout=5)
        assert "stopped" in err
        assert ADMIN_KEY not in err and TOKEN not in err
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        stop(proc)


def test_agent_mode_env_settings_port_in_use_and_sigint(stack: Stack, tmp_path: Path) -> None:
    environ = env(AREAL_GATEWAY_ROUTER_ADDR=stack.router_addr, AREAL_GATEWAY_MODE="agent")
    proc, info = start([], tmp_path / "a.json", environ)
    try:
        url = f"http://127.0.0.1:{info['port']}"
        assert httpx.get(url + "/health").json()["mode"] == "agent"
        assert httpx.get(url + "/metrics").status_code == 200
        # agent mode: every endpoint but health and metrics needs a key
        r = httpx.post(url + "/v1/chat/completions", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401  # listed, with a key
        # the port is taken: a second gateway says so and exits 1
        r2 = run(["--router-addr", stack.router_addr, "--port", str(info["port"])], env=env())
        assert r2.returncode == 1 and "cannot listen" in r2.stderr
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        stop(proc)


def test_two_gateways_share_one_port_each_with_its_own(stack: Stack, tmp_path: Path) -> None:
    """--reuse-port: both serve the shared port (the kernel spreads connections); --own-port:
    each answers its own health probe on a loopback port of its own."""
    stack.register("m-two")
    base = ["--router-addr", stack.router_addr, "--reuse-port", "--own-port", "0"]
    first, info1 = start([*base, "--port", "0", "--no-proxy-streams"], tmp_path / "g1.json")
    second = None
    try:
        port = info1["port"]
        second, info2 = start(
            [*base, "--port", str(port), "--no-proxy-streams"], tmp_path / "g2.json"
        )
        assert info2["port"] == port and info1["own_port"] != info2["own_port"]
        for proc, info in ((first, info1), (second, info2)):
            own = httpx.get(f"http://127.0.0.1:{info['own_port']}/health").json()
            assert own["pid"] == proc.pid
        # New connections reach both; each serves a model registered before it started.
        pids = set()
        for _ in range(64):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
                pids.add(c.get("/health").json()["pid"])
                r = c.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    json={"model": "m-two", "messages": MESSAGES},
                )
                assert r.status_code == 200, r.text
            if len(pids) == 2:
                break
        assert pids == {first.pid, second.pid}
        # One stops: the other keeps the port.
        first.send_signal(signal.SIGTERM)
        assert first.wait(15) == 0
        for _ in range(8):
            assert httpx.get(f"http://127.0.0.1:{port}/health").json()["pid"] == second.pid
        # A gateway without --reuse-port cannot take the shared port.
        r = run(["--router-addr", stack.router_addr, "--port", str(port)], env=env())
        assert r.returncode != 0
    finally:
        stop(first)
        if second is not None:
            stop(second)
