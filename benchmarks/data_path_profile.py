"""Where a request's CPU goes in areal's data path: per process, per library, per syscall.

    uv run python benchmarks/data_path_profile.py [--who recorded|admin] [--stream]
        [--concurrency 1] [--requests 3000] [--top 12]

The stack of benchmarks/vs_smg.py (router, gateway, one data proxy in front of the
zero-cost fake engine) under the same chat body. Three readings of the same load:

1. CPU ms per request of each process, from /proc/<pid>/stat (as vs_smg.py);
2. py-spy (`--gil`: only samples holding the GIL, so idle waits are not counted) on the
   gateway and the proxy: each process's samples by the library of the innermost Python
   frame (uvicorn, grpc, aiohttp, sqlite, areal's own packages...) and the top frames;
3. `strace -c -f` on the gateway and the proxy over a shorter run: syscalls per request by
   name (each gRPC message, HTTP write, thread hand-off and SQLite page is one or more).

py-spy and strace are optional: a reading whose tool is missing is skipped, with the
command that installs it. Numbers move with the machine's load; read them as shares.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY  # noqa: E402
from vs_smg import chat_body, run_load, start_fake_engine, start_quiet_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

_FRAME_FILE = re.compile(r"\(([^():]+)(?::\d+)?\)\s*$")


def _library(frame: str) -> str:
    """`uvicorn`, `grpc`, `areal_proxy`, `asyncio/tasks.py`... of a py-spy frame."""
    m = _FRAME_FILE.search(frame)
    path = m.group(1) if m else frame
    parts = path.split("/")
    if parts[0] == "asyncio" and len(parts) > 1:
        return "asyncio/" + parts[1]
    return parts[0] if len(parts) > 1 else path


def py_spy_summary(path: Path, top: int) -> list[str]:
    libs: collections.Counter[str] = collections.Counter()
    frames: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        innermost = stack.split(";")[-1]
        libs[_library(innermost)] += count
        frames[innermost] += count
    if not total:
        return ["  (no samples)"]
    out = ["  by library (innermost Python frame):"]
    out += [f"    {v / total * 100:5.1f} %  {k}" for k, v in libs.most_common(top)]
    out.append("  top frames:")
    out += [f"    {v / total * 100:5.1f} %  {k}" for k, v in frames.most_common(top)]
    return out


def strace_summary(path: Path, requests: int, floor: float = 0.3) -> list[str]:
    rows = []
    total = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
            calls = int(parts[3])
            total += calls
            rows.append((calls / requests, parts[-1]))
    out = [f"  {total / requests:.1f} syscalls per request; those at {floor} or more:"]
    out += [f"    {per:6.2f}  {name}" for per, name in sorted(rows, reverse=True) if per >= floor]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--who", choices=["recorded", "admin"], default="recorded")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="areal-profile-"))
    engine, engine_url = start_fake_engine(tmp, args.tokens)
    try:
        stack = start_quiet_stack(tmp, engine_url)
    except BaseException:
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
        raise
    try:
        key = ADMIN_KEY
        if args.who == "recorded":
            r = httpx.post(
                stack.gateway_url + "/rl/start_session",
                json={"task_id": "profile", "group_size": 1},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=30,
            )
            r.raise_for_status()
            key = r.json()["sessions"][0]["session_api_key"]
        url = stack.gateway_url + "/v1/chat/completions"
        body = chat_body(args.stream, args.tokens)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        pids = {
            "gateway": stack.gateway.popen.pid,
            "router": stack.router.popen.pid,
            "proxy": stack.proxies[0].popen.pid,
        }
        conc, stream = args.concurrency, args.stream

        def load(n: int, warmup: int = 50) -> dict:
            return asyncio.run(
                run_load(
                    url, body, headers, n, conc, stream, {k: [p] for k, p in pids.items()}, warmup
                )
            )

        load(200, 0)  # warm-up
        what = f"{args.who}, {'stream' if stream else 'non-stream'}, c={conc}"
        spy = shutil.which("py-spy")
        spies = []
        if spy:
            seconds = 10
            for name in ("gateway", "proxy"):
                out = tmp / f"{name}.pyspy"
                cmd = [spy, "record", "--pid", str(pids[name]), "--gil", "--nonblocking"]
                cmd += ["-r", "400", "-d", str(seconds), "-f", "raw", "-o", str(out)]
                spies.append((name, out, subprocess.Popen(cmd, stderr=subprocess.DEVNULL)))
            time.sleep(0.5)  # py-spy attaches
        res = load(args.requests, 0)
        cpu = res["cpu_ms"]
        for _, _, proc in spies:
            proc.wait()
        print(
            f"\n== {what}: {args.requests} requests, {res['rps']:.0f} req/s, p50 {res['p50']:.2f} ms"
        )
        print("CPU ms per request: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
        print(f"  areal total {sum(cpu.values()):.3f}")
        if not spy:
            print("\npy-spy not found (pip install py-spy): no sample profile")
        for name, out, _ in spies:
            print(f"\n-- {name}: py-spy, samples holding the GIL ({what})")
            if out.exists():
                print("\n".join(py_spy_summary(out, args.top)))
            else:
                print("  (py-spy wrote nothing: it may need ptrace permission)")
        tracer = shutil.which("strace")
        if not tracer:
            print("\nstrace not found (apt-get install strace): no syscall counts")
            return 0
        n = min(args.requests, 500)
        traces = []
        for name in ("gateway", "proxy"):
            out = tmp / f"{name}.strace"
            cmd = [tracer, "-c", "-f", "-p", str(pids[name]), "-o", str(out)]
            traces.append((name, out, subprocess.Popen(cmd, stderr=subprocess.DEVNULL)))
        time.sleep(1.0)  # strace attaches to every thread
        load(n, 0)
        for _, _, proc in traces:
            proc.send_signal(signal.SIGINT)
        for _, _, proc in traces:
            proc.wait()
        for name, out, _ in traces:
            print(f"\n-- {name}: strace -c over {n} requests ({what})")
            print("\n".join(strace_summary(out, n)) if out.exists() else "  (no output)")
    finally:
        stack.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
