"""Gateway overhead benchmark against a FAKE router and a FAKE zero-cost proxy.

    uv run python packages/areal-gateway/bench/bench_overhead.py [--requests 2000] [--concurrency 32]

Starts the fakes in this process (their own thread/loop), the real `areal-gateway` as a
subprocess, and measures (a) a plain gRPC call straight to the fake proxy and (b) the same
request through the gateway over HTTP, at concurrency 1 (latency) and N (throughput). The
difference of (b) and (a) at concurrency 1 is the gateway's own cost, plus the HTTP client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakes import PROXY_SERVICES, TOKEN, BackgroundLoop, FakeProxy, FakeRouter, start_grpc

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc

ADMIN = "bench-admin-key-0123456789"
BODY = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
)


class QuietProxy(FakeProxy):
    def _record(self, method, request, context):  # type: ignore[no-untyped-def]
        return {}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1000


async def direct(addr: str, n: int) -> list[float]:
    import grpc

    ch = grpc.aio.insecure_channel(addr)
    stub = proxy_pb2_grpc.InferenceProxyServiceStub(ch)
    md = (("x-areal-internal-token", TOKEN),)
    req = envelope_pb2.OpenAIRequest(envelope=envelope_pb2.Envelope(model="bench"), body=BODY)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await stub.ChatCompletion(req, metadata=md)
        out.append(time.perf_counter() - t)
    await ch.close()
    return out


async def through(url: str, n: int, conc: int, stream: bool) -> tuple[list[float], float]:
    body = BODY if not stream else BODY[:-1] + b',"stream":true}'
    lat: list[float] = []
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as c:
        h = {"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t = time.perf_counter()
                r = await c.post("/v1/chat/completions", content=body, headers=h)
                assert r.status_code == 200, r.text
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return lat, n / (time.perf_counter() - t0)


async def health(url: str, n: int) -> tuple[list[float], float]:
    lat = []
    async with httpx.AsyncClient(base_url=url) as c:
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            await c.get("/health")
            lat.append(time.perf_counter() - t)
        return lat, n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--profile", default="", help="write a cProfile of the gateway here")
    args = ap.parse_args()

    bg = BackgroundLoop()
    router, proxy = FakeRouter(), QuietProxy("bench-0")

    servers = []  # keep the servers referenced (a collected grpc.aio server stops)

    async def setup() -> tuple[int, int]:
        rs, rport = await start_grpc(router, router_pb2_grpc.add_RouterServiceServicer_to_server)
        ps, pport = await start_grpc(proxy, *PROXY_SERVICES)
        servers.extend((rs, ps))
        return rport, pport

    rport, pport = bg.run(setup())
    router.models["bench"] = router_pb2.ModelInfo(name="bench", kind=router_pb2.MODEL_KIND_INTERNAL)
    router.proxies["bench-0"] = router_pb2.ProxyInfo(
        proxy_id="bench-0",
        address=f"127.0.0.1:{pport}",
        model="bench",
        health=router_pb2.PROXY_HEALTH_HEALTHY,
    )
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    env = {**os.environ, "AREAL_ADMIN_API_KEY": ADMIN, "AREAL_INTERNAL_TOKEN": TOKEN}
    gw = subprocess.Popen(
        [
            sys.executable,
            *(["-m", "cProfile", "-o", args.profile] if args.profile else []),
            "-m",
            "areal_gateway",
            "--router-addr",
            f"127.0.0.1:{rport}",
            # The fake proxy answers the per-call RPCs only (benchmarks/gateway_overhead.py
            # measures the Generate stream against a real proxy).
            "--no-proxy-streams",
            "--ready-file",
            str(ready),
            "--log-level",
            "warning",
        ],
        env=env,
        start_new_session=True,
    )
    try:
        while not ready.exists():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
        asyncio.run(through(url, 200, 4, False))  # warm up
        c0 = cpu_seconds(gw.pid)
        lat, rps = asyncio.run(health(url, args.requests))
        cpu = (cpu_seconds(gw.pid) - c0) / args.requests * 1000
        print(f"GET /health, c=1: p50 {pct(lat, 0.5):.2f} ms  gateway CPU {cpu:.2f} ms/request")
        d = asyncio.run(direct(f"127.0.0.1:{pport}", args.requests))
        print(
            f"direct gRPC to fake proxy, c=1: p50 {pct(d, 0.5):.2f} ms  p99 {pct(d, 0.99):.2f} ms"
        )
        for stream in (False, True):
            kind = "stream" if stream else "non-stream"
            c0 = cpu_seconds(gw.pid)
            lat, _ = asyncio.run(through(url, args.requests, 1, stream))
            cpu = (cpu_seconds(gw.pid) - c0) / args.requests * 1000
            print(
                f"through gateway {kind}, c=1: p50 {pct(lat, 0.5):.2f} ms  p99 {pct(lat, 0.99):.2f} ms"
                f"  gateway CPU {cpu:.2f} ms/request"
            )
            c0 = cpu_seconds(gw.pid)
            lat, rps = asyncio.run(through(url, args.requests * 2, args.concurrency, stream))
            cpu = (cpu_seconds(gw.pid) - c0) / (args.requests * 2) * 1000
            print(
                f"through gateway {kind}, c={args.concurrency}: {rps:.0f} req/s"
                f"  p50 {pct(lat, 0.5):.2f} ms  gateway CPU {cpu:.2f} ms/request"
            )
    finally:
        os.killpg(gw.pid, signal.SIGTERM)
        gw.wait(15)
        bg.close()


if __name__ == "__main__":
    main()
