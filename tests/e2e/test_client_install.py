"""areal-client on its own: installed alone into a fresh venv (no service package, no FastAPI,
uvicorn or gRPC there), it runs an RL session against a running inference service.

The script runs with that venv's Python in isolated mode from a temporary folder, so nothing
of the workspace can leak onto its import path; what it exported is checked against the
same session exported by the test itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT, ROOT

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

# What a trainer must not get by installing the client: the services' stacks.
ABSENT = (
    "fastapi",
    "starlette",
    "uvicorn",
    "grpc",
    "areal_gateway",
    "areal_proxy",
    "areal_runtime",
    "areal_proto",
    "openai",
)

PROBE = """
import importlib.util, json, sys
names = sys.argv[1:]
print(json.dumps({n: importlib.util.find_spec(n) is not None for n in names}))
"""

SESSION_SCRIPT = """
import asyncio, json, sys
from areal_client import ArealClient, AsyncArealClient, NotFoundError

url, key = sys.argv[1], sys.argv[2]
with ArealClient(url, key, timeout=60) as areal:
    [model] = areal.served_models()
    session = areal.start_session(task_id="clean-venv")
    # A chat with the session key (no OpenAI SDK here: plain HTTP on the client's pool).
    r = areal.http_client.post(
        "/v1/chat/completions",
        headers={"Authorization": "Bearer " + session.api_key},
        json={"model": model, "messages": [{"role": "user", "content": "hello there"}],
              "max_tokens": 3, "temperature": 0},
    )
    r.raise_for_status()
    chat = r.json()
    reward = areal.set_reward(session, 0.75)
    rows = areal.export(session_ids=[session.session_id])
    streamed = list(areal.iter_export(session=session))
    try:
        areal.export(group_id="group-does-not-exist")
        missing = None
    except NotFoundError as e:
        missing = {"status": e.status, "code": e.code, "message": e.message}

async def workers():
    async with AsyncArealClient(url, key, timeout=60) as aio:
        return [w.proxy_id for w in await aio.list_workers()]

print(json.dumps({
    "session_id": session.session_id,
    "chat_id": chat["id"],
    "completion_tokens": chat["usage"]["completion_tokens"],
    "rewarded": reward.interaction_id,
    "rows": [row.to_dict() for row in rows],
    "streamed_equal": [row.to_dict() for row in streamed] == [row.to_dict() for row in rows],
    "missing": missing,
    "workers": asyncio.run(workers()),
}))
"""


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "uv is needed to build the clean venv (scripts/bootstrap.sh installs it)"
    return uv


def _clean_env() -> dict[str, str]:
    # Nothing of the workspace venv may reach the subprocesses.
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT", "CONDA_PREFIX")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), **kw)
    assert done.returncode == 0, (
        f"{argv[:4]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    )
    return done


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    uv = _uv()
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    install = [
        uv,
        "pip",
        "install",
        "--quiet",
        "--python",
        str(python),
        str(ROOT / "packages" / "areal-client"),
    ]
    # From uv's cache when it holds httpx (CI, after `uv sync`); from the index otherwise.
    offline = subprocess.run(
        [*install, "--offline"], capture_output=True, text=True, env=_clean_env()
    )
    if offline.returncode != 0:
        _run(install)
    return python


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory: pytest.TempPathFactory):
    s = start_stack(
        tmp_path_factory.mktemp("client-install"), sglang_engine.url, PARROT, n_proxies=1
    )
    yield s
    s.stop()


def test_clean_venv_has_the_client_and_none_of_the_services(
    client_python: Path, tmp_path: Path
) -> None:
    names = ["areal_client", "httpx", *ABSENT]
    probe = _run([str(client_python), "-I", "-c", PROBE, *names], cwd=tmp_path)
    found = json.loads(probe.stdout)
    assert found["areal_client"] and found["httpx"], found
    assert [n for n in ABSENT if found[n]] == [], found


def test_clean_venv_client_runs_an_rl_session(client_python: Path, stack, tmp_path: Path) -> None:
    script = tmp_path / "session.py"
    script.write_text(SESSION_SCRIPT)
    done = _run(
        [str(client_python), "-I", str(script), stack.gateway_url, ADMIN_KEY],
        cwd=tmp_path,
        timeout=120,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    [row] = out["rows"]
    assert out["rewarded"] == out["chat_id"] == row["interaction_id"]
    assert row["session_id"] == out["session_id"] and row["task_id"] == "clean-venv"
    assert row["reward"] == 0.75
    assert sum(row["loss_mask"]) == out["completion_tokens"] > 0
    assert (
        len(row["input_ids"])
        == len(row["logprobs"])
        == len(row["versions"])
        == len(row["loss_mask"])
    )
    assert out["streamed_equal"] is True
    assert out["missing"]["status"] == 404 and out["missing"]["message"]
    assert out["workers"] == [p.comp.name for p in stack.proxies]
    # The same session, exported here over plain HTTP: what the clean venv read is the record.
    with httpx.Client(base_url=stack.gateway_url, timeout=60) as c:
        r = c.post(
            "/rl/export_trajectories",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={"session_ids": [out["session_id"]], "remove_session": True},
        )
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [row]
