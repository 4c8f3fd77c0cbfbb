"""Run coding-agent harnesses against a real areal stack, everything inside one network
namespace with only loopback (the test re-executes this file under `unshare --net`).

    unshare --net --pid --fork --kill-child --mount-proc \
        python tests/harness/harness_driver.py --out DIR --engine scripted \
        --scenario opencode:opencode:1 --scenario mini:mini:1

It brings loopback up, starts the engine (the scripted engine, or SGLang serving SmolLM2
behind the same engine's logging relay), one stack (router, gateway, one data proxy; the code
the e2e suites use), and per scenario `NAME:HARNESS[:FAIL_STEP]`: an RL session, the harness
run with the session key as its API key in a fresh HOME and folder, then both exports of the
session, its status and the engine's log lines of that run. Each scenario's result is
`DIR/NAME.json`; a scenario that fails to run says why there and the next one runs.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "e2e")]

import httpx  # noqa: E402
from harness_setup import Bounds, installed, prepare  # noqa: E402
from stack import ADMIN_KEY, Stack, start_stack  # noqa: E402
from testpaths import PARROT  # noqa: E402

from areal_cli import engines, supervisor  # noqa: E402

HARNESS_TIMEOUT_S = 240
# The scripted engine serves the parrot's tokenizer (512 ids) with a context that holds
# Claude Code's first prompt (~50k of those ids).
SCRIPTED_CONTEXT = 131072
# SmolLM2 on 2 shared cores writes a few tokens a second: 32 tokens a call, 2 steps.
SMOL_BOUNDS = Bounds(context=8192, output=32, steps=2)


def loopback_up() -> None:
    """`ip link set lo up` without iproute2: a new network namespace's loopback is down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, ifr))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def spawn_ready(name: str, argv: list[str], log_dir: Path, timeout: float) -> dict[str, Any]:
    ready = log_dir / f"{name}.ready.json"
    popen, comp = supervisor.spawn(
        name, [*argv, "--ready-file", str(ready)], log_dir / f"{name}.log"
    )
    supervisor.wait_ready(popen, comp, lambda: bool(supervisor.read_ready_file(ready)), timeout)
    return supervisor.read_ready_file(ready) or {}


def start_engine(kind: str, out: Path) -> tuple[str, Path, str, list[str]]:
    """(engine url the proxy uses, tokenizer folder, model name, proxy flags)."""
    log = out / "engine-calls.jsonl"
    log.touch()
    scripted = [sys.executable, str(HERE / "scripted_engine.py"), "--log", str(log)]
    if kind == "scripted":
        info = spawn_ready("scripted-engine", [*scripted, "--model-path", str(PARROT)], out, 30)
        flags = ["--tool-call-parser", "hermes", "--context-length", str(SCRIPTED_CONTEXT)]
        return f"http://127.0.0.1:{info['port']}", PARROT, "scripted", flags
    from areal_cli.models import resolve_short_name

    folder = Path(resolve_short_name("smollm2") or "")
    port = supervisor.free_port()
    launch = engines.engine_launch(
        "sglang",
        python=engines.resolve_python("sglang"),
        model_path=str(folder),
        served_name="smol",
        host="127.0.0.1",
        port=port,
        extra_args=engines.SGLANG_CPU_ARGS.split(),
        # The model's whole 8k context as KV cache (the CPU default, 4096, would refuse
        # OpenCode's first prompt for want of cache, not of context).
        user_args=["--max-total-tokens", "16384"],
    )
    popen, comp = supervisor.spawn(
        "smol-engine", launch.argv, out / "smol-engine.log", env=launch.env
    )
    url = f"http://127.0.0.1:{port}"
    supervisor.wait_ready(popen, comp, lambda: supervisor.http_ok(url + "/health"), 600)
    info = spawn_ready("relay", [*scripted, "--model-path", str(folder), "--relay", url], out, 30)
    return f"http://127.0.0.1:{info['port']}", folder, "smol", []


def admin(stack: Stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
    )


def export(stack: Stack, sid: str, style: str) -> list[dict[str, Any]]:
    with admin(stack) as c:
        r = c.post("/rl/export_trajectories", json={"session_ids": [sid], "style": style})
    r.raise_for_status()
    return r.json()["rows"]


def run_scenario(
    stack: Stack,
    engine_url: str,
    model: str,
    exe: str,
    harness: str,
    fail_step: int,
    root: Path,
    log: Path,
) -> dict[str, Any]:
    if model == "scripted":
        r = httpx.post(engine_url + "/script", json={"fail_once_at_step": fail_step}, timeout=10)
        r.raise_for_status()
    with admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": harness, "group_size": 1})
    r.raise_for_status()
    [sess] = r.json()["sessions"]
    # The scripted engine's runs end by rule; a real model's are bounded.
    bounds = SMOL_BOUNDS if model == "smol" else None
    run = prepare(
        harness, exe, stack.gateway_url, sess["session_api_key"], model, root, bounds=bounds
    )
    seen = len(log.read_text().splitlines())
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            run.argv,
            env=run.env,
            cwd=run.cwd,
            capture_output=True,
            text=True,
            timeout=HARNESS_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = -1
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        stderr += f"\n[driver] timed out after {HARNESS_TIMEOUT_S}s"
    seconds = time.monotonic() - t0
    calls = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
    with admin(stack) as c:
        status = c.get(f"/rl/sessions/{sess['session_id']}").json()
    files = {f.name: f.read_text(errors="replace")[:2000] for f in run.cwd.iterdir() if f.is_file()}
    trajectory = None
    if run.trajectory is not None and run.trajectory.exists():
        doc = json.loads(run.trajectory.read_text())
        trajectory = {"info": doc.get("info", {}), "n_messages": len(doc.get("messages", []))}
    return {
        "harness": harness,
        "session_id": sess["session_id"],
        "rc": rc,
        "stdout": stdout[-20000:],
        "stderr": stderr[-20000:],
        "seconds": round(seconds, 1),
        "engine_calls": calls,
        "rows_individual": export(stack, sess["session_id"], "individual"),
        "rows_concat": export(stack, sess["session_id"], "concat"),
        "session_status": status,
        "files": files,
        "trajectory": trajectory,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", choices=["scripted", "smollm2"], default="scripted")
    ap.add_argument("--scenario", action="append", default=[], help="NAME:HARNESS[:FAIL_STEP]")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loopback_up()
    exes = installed()
    t0 = time.monotonic()
    url, tokenizer, model, proxy_flags = start_engine(args.engine, out)
    stack = start_stack(
        out / "stack", url, tokenizer, model=model, n_proxies=1, proxy_args=proxy_flags
    )
    timings = {"setup_s": round(time.monotonic() - t0, 1)}
    try:
        for spec in args.scenario:
            name, harness, *rest = spec.split(":")
            fail_step = int(rest[0]) if rest else -1
            root = out / name
            try:
                result = run_scenario(
                    stack, url, model, exes[harness], harness, fail_step, root,
                    out / "engine-calls.jsonl",
                )  # fmt: skip
            except Exception:
                result = {"harness": harness, "error": traceback.format_exc()}
            (out / f"{name}.json").write_text(json.dumps(result))
    finally:
        stack.stop()
        (out / "driver.json").write_text(json.dumps(timings))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
