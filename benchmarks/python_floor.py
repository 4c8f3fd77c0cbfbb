"""What the pieces areal's data path is built from cost alone, before areal does anything.

    uv run python benchmarks/python_floor.py [--requests 3000]

Each floor is a process that does nothing but the one thing, measured as CPU ms per request
from /proc/<pid>/stat, at concurrency 1, on loopback:

* `uvicorn`: an ASGI app (uvicorn + httptools + uvloop, as the gateway runs) that answers
  every POST with a fixed 400-byte JSON body without reading it further;
* `grpc aio server` / `grpc aio client`: a bidirectional stream carrying one request frame
  and one answer frame per request (as the gateway -> proxy hop does), server and client each
  in its own process on uvloop;
* `aiohttp client`: a client in its own process POSTing a 300-byte JSON body to the
  zero-cost fake engine and reading its answer (as the proxy calls the engine).

A gateway is at least `uvicorn` + `grpc aio client`; a proxy at least `grpc aio server` +
`aiohttp client`. Their sum is the floor of a Python gateway -> proxy -> engine path, to set
beside SMG's CPU per request in benchmarks/vs_smg.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import launch  # noqa: E402

from areal_cli import supervisor  # noqa: E402

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 200}]}).encode()

_UVICORN = textwrap.dedent(
    """
    import json, socket, sys
    import uvicorn
    ANSWER = json.dumps({"id": "x", "choices": [{"text": "y" * 330}]}).encode()
    HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        await send({"type": "http.response.body", "body": ANSWER})
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(128)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, http="httptools", loop="uvloop", log_config=None, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    """
)

_GRPC_SERVER = textwrap.dedent(
    """
    import asyncio, grpc, uvloop
    from grpc.aio import server
    def ident(b):
        return b
    async def echo(requests, context):
        async for frame in requests:
            yield frame[:64] + b"." * 300
    async def main():
        s = server()
        handler = grpc.method_handlers_generic_handler(
            "floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo, ident, ident)})
        s.add_generic_rpc_handlers((handler,))
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        print(port, flush=True)
        await s.wait_for_termination()
    uvloop.run(main())
    """
)

_GRPC_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, grpc, uvloop
    async def main(port, n):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_stream("/floor.Echo/Stream", lambda b: b, lambda b: b)()
            frame = b"r" * 400
            for _ in range(200):
                await call.write(frame); await call.read()
            print("ready", flush=True)
            sys.stdin.readline()
            for _ in range(n):
                await call.write(frame); await call.read()
            await call.done_writing()
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
    """
)

_AIOHTTP_CLIENT = textwrap.dedent(
    """
    import asyncio, sys, aiohttp, uvloop
    async def main(url, n, body):
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                async with http.post(url, data=body) as r:
                    await r.read()
            print("ready", flush=True)
            sys.stdin.readline()
            for _ in range(n):
                async with http.post(url, data=body) as r:
                    await r.read()
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()))
    """
)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _measured_client(code: str, n: int, *args: str, server: int | None = None) -> dict:
    """Runs a client that warms up, waits for a line, then makes `n` requests; the CPU per
    request of the client (and of `server`, a pid) over those `n`."""
    proc = _spawn(code, *args)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("client did not start")
        before = cpu_seconds(proc.pid), cpu_seconds(server) if server else 0.0
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        # The client's own CPU, read just before it exits (it leaves once its n are done).
        client_cpu = before[0]
        while proc.poll() is None:
            try:
                client_cpu = cpu_seconds(proc.pid)
            except OSError:
                break
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        out = {"rps": n / wall, "client": (client_cpu - before[0]) / n * 1e3}
        if server:
            out["server"] = (cpu_seconds(server) - before[1]) / n * 1e3
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def _http_load(port: int, n: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            async with http.post(f"http://127.0.0.1:{port}/", data=BODY) as r:
                await r.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    n = args.requests
    rows: list[tuple[str, float]] = []

    server = _spawn(_UVICORN)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        asyncio.run(_http_load(port, 200))
        before = cpu_seconds(server.pid)
        asyncio.run(_http_load(port, n))
        rows.append(
            ("uvicorn (an answer, nothing else)", (cpu_seconds(server.pid) - before) / n * 1e3)
        )
    finally:
        server.terminate()
        server.wait()

    server = _spawn(_GRPC_SERVER)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        got = _measured_client(_GRPC_CLIENT, n, str(port), str(n), server=server.pid)
        rows.append(("grpc aio server (stream, a frame each way)", got["server"]))
        rows.append(("grpc aio client (stream, a frame each way)", got["client"]))
    finally:
        server.terminate()
        server.wait()

    tmp = Path(tempfile.mkdtemp(prefix="areal-floor-"))
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    try:
        url = f"http://127.0.0.1:{engine.info['port']}/v1/chat/completions"
        got = _measured_client(_AIOHTTP_CLIENT, n, url, str(n), BODY.decode())
        rows.append(("aiohttp client (a POST to the fake engine)", got["client"]))
    finally:
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})

    print(f"\nCPU ms per request of each piece alone, c=1, {n} requests, loopback\n")
    for name, ms in rows:
        print(f"  {name:<46} {ms:6.3f}")
    by = dict(rows)
    gateway = (
        by["uvicorn (an answer, nothing else)"] + by["grpc aio client (stream, a frame each way)"]
    )
    proxy = (
        by["grpc aio server (stream, a frame each way)"]
        + by["aiohttp client (a POST to the fake engine)"]
    )
    print(f"\n  floor of a gateway (uvicorn + grpc client)      {gateway:6.3f}")
    print(f"  floor of a proxy (grpc server + aiohttp client) {proxy:6.3f}")
    print(f"  floor of gateway -> proxy -> engine            {gateway + proxy:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
