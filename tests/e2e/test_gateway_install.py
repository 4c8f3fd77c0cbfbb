"""areal-gateway on its own: its wheel and its dependencies' (areal-proto, areal-runtime) in a
fresh venv, and nothing of the other services; that gateway serves chats through a running
router and proxy of the workspace.

The clean venv's gateway is started with the same internal token as the stack's router, on
its own port, and a chat and an RL session go through it to the real engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from stack import ADMIN_KEY, launch, start_stack
from test_client_install import PROBE, _clean_env, _run, _uv
from testpaths import PARROT, ROOT

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

# Workspace packages the gateway must not need, and the proxy's heavy dependencies.
ABSENT = ("areal_proxy", "areal_router", "areal_cli", "areal_client", "areal_agent_worker",
          "areal_agent_proxy", "tokenizers", "aiohttp", "jinja2")  # fmt: skip
PRESENT = ("areal_gateway", "areal_proto", "areal_runtime", "fastapi", "grpc")


@pytest.fixture(scope="module")
def gateway_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("gateway-venv") / "venv"
    uv = _uv()
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    pkgs = [str(ROOT / "packages" / p) for p in ("areal-proto", "areal-runtime", "areal-gateway")]
    install = [uv, "pip", "install", "--quiet", "--python", str(python), *pkgs]
    # From uv's cache when it holds the dependencies (CI, after `uv sync`); else the index.
    offline = subprocess.run(
        [*install, "--offline"], capture_output=True, text=True, env=_clean_env()
    )
    if offline.returncode != 0:
        _run(install)
    return venv


def test_gateway_installs_without_the_other_services(gateway_venv: Path, tmp_path: Path) -> None:
    python = gateway_venv / "bin" / "python"
    probe = _run([str(python), "-I", "-c", PROBE, *PRESENT, *ABSENT], cwd=tmp_path)
    found = json.loads(probe.stdout)
    assert all(found[n] for n in PRESENT), found
    assert [n for n in ABSENT if found[n]] == [], found
    version = _run([str(gateway_venv / "bin" / "areal-gateway"), "--version"], cwd=tmp_path)
    assert version.stdout.strip()


def test_clean_venv_gateway_serves_through_the_workspace_stack(
    gateway_venv: Path, sglang_engine, tmp_path: Path
) -> None:
    stack = start_stack(tmp_path / "stack", sglang_engine.url, PARROT, n_proxies=1)
    try:
        alone = launch(
            "gateway-alone",
            [
                str(gateway_venv / "bin" / "areal-gateway"),
                "--port",
                "0",
                "--router-addr",
                stack.router.address,
            ],
            tmp_path,
            {**_clean_env(), **stack.env},
        )
        try:
            url = f"http://{alone.info['host']}:{alone.info['port']}"
            auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
            with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
                r = c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "tiny-parrot",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 3,
                    },
                )
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] > 0
                r = c.post("/rl/start_session", json={"task_id": "alone"})
                assert r.status_code == 201, r.text
                assert r.json()["sessions"][0]["session_api_key"].startswith("areal-sk-")
        finally:
            from areal_cli import supervisor

            supervisor.terminate([[alone.comp]], grace=5, procs={alone.popen.pid: alone.popen})
    finally:
        stack.stop()
