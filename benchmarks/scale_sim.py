"""The router's control plane at 1 to 1,000 replicas, against simulated proxies.

    uv run python benchmarks/scale_sim.py [--sizes 1,64,256,1000] [--window 15] [--settle 10]
        [--routes 2000] [--json PATH]
    uv run python benchmarks/scale_sim.py --real 64     # 64 real areal-proxy processes instead

A *simulated proxy* serves the part of the proxy's gRPC contract the router and the gateway's
admin API call: `ProxyStatusService.GetStats` (healthy, idle, the model it was started for)
and `grpc.health.v1` (`Check` and the `Watch` stream), behind the same internal-token check
and server options as a real proxy. A few host processes (this file with `--serve`) each run
up to 250 of them, one `grpc.aio` server per port. The real router and gateway are started
as the CLI starts them (through `tests/e2e/stack.py`, i.e. `areal_cli.supervisor`; the router
with an SQLite `--state-file`, default `--health-interval`), the N proxies registered as one
model with one `POST /admin/models`, and then, per N:

* `register`: wall time of that `POST /admin/models` (every proxy is polled once and healthy
  when it answers);
* `router idle CPU`: the router's CPU time (user + system, psutil) over `--window` seconds,
  `--settle` seconds after the registration, nothing routed: what health and load tracking
  cost;
* `route p50 / p99`: `--routes` sequential `Route` calls (policy `least_loaded`, the one that
  looks at every proxy) made straight to the router's gRPC port from this process: the
  round trip, gRPC hop included (the decision alone is less);
* `decision p50 / p99`: the same calls as the router's own histogram
  (`areal_router_route_latency_seconds`) sees them: the upper bound of the bucket holding
  the quantile (the decision took at most that long);
* `dead -> unroutable`: one simulated proxy's server is stopped (its connections close, as
  when a proxy process dies) while `Route` (round robin over all N, one call at a time) is
  called; the time from the kill to the last call that still named it;
* gateway and router RSS (psutil) at the end.

`--real N` starts the zero-cost fake engine (`fake_engine.py`) and N real `areal-proxy`
processes in front of it instead (much heavier: N Python processes), to check that a
simulated proxy costs the router what a real one does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, Proc, launch  # noqa: E402

from areal_cli import supervisor  # noqa: E402

MODEL = "tiny-parrot"
PER_HOST = 250  # simulated proxies per host process


# -- the simulated proxies (run in host processes: --serve) --------------------------------


async def serve_sims(n: int, model: str, ready_file: str) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
    from areal_runtime.auth import server_interceptors
    from areal_runtime.ready import write_ready_file

    class Status(proxy_pb2_grpc.ProxyStatusServiceServicer):
        def __init__(self, proxy_id: str) -> None:
            self.proxy_id = proxy_id

        async def GetStats(self, request, context):  # type: ignore[no-untyped-def]
            return proxy_pb2.ProxyStats(healthy=True, model=model, engine_url=self.proxy_id)

    servers: list[grpc.aio.Server] = []
    ports: list[int] = []
    for i in range(n):
        server = grpc.aio.server(
            interceptors=server_interceptors(),
            # As a real proxy's server (areal_proxy.server): pings are never abuse.
            options=[
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(Status(f"sim-{i}"), server)
        h = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await h.set("", health_pb2.HealthCheckResponse.SERVING)
        servers.append(server)
        ports.append(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    killed: list[asyncio.Task[None]] = []
    # SIGUSR1: the first simulated proxy dies (its server stops, connections close).
    loop.add_signal_handler(
        signal.SIGUSR1, lambda: killed.append(loop.create_task(servers[0].stop(0)))
    )
    write_ready_file(ready_file, host="127.0.0.1", port=ports[0], version="sim", ports=ports)
    await stop.wait()
    await asyncio.gather(*(s.stop(0) for s in servers))


# -- the harness --------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def route_buckets(router: Proc) -> dict[float, float]:
    """The router's own decision-time histogram (`areal_router_route_latency_seconds`):
    cumulative count by upper bound, summed over its labels."""
    body = httpx.get(f"http://127.0.0.1:{router.info['metrics_port']}/metrics", timeout=10).text
    out: dict[float, float] = {}
    for line in body.splitlines():
        if line.startswith("areal_router_route_latency_seconds_bucket{"):
            head, _, value = line.rpartition(" ")
            le = head.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            out[bound] = out.get(bound, 0.0) + float(value)
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile `q` of the calls between
    the two scrapes (seconds): the decision took at most this long."""
    diff = {b: after[b] - before.get(b, 0.0) for b in after}
    total = diff.get(float("inf"), 0.0)
    return next(b for b in sorted(diff) if diff[b] >= q * total)


def start_router_gateway(
    tmp: Path, env: dict[str, str], router_args: list[str]
) -> tuple[Proc, Proc]:
    quiet = ["--log-level", "warning"]
    state = str(tmp / "router-state.sqlite")
    router = launch(
        "router",
        ["areal-router", "--port", "0", "--state-file", state, *quiet, *router_args],
        tmp,
        env,
    )
    try:
        gateway = launch(
            "gateway",
            ["areal-gateway", "--port", "0", "--router-addr", router.address, *quiet],
            tmp,
            env,
        )
    except BaseException:
        supervisor.terminate([[router.comp]], grace=2, procs={router.popen.pid: router.popen})
        raise
    return router, gateway


def start_sim_hosts(tmp: Path, n: int, env: dict[str, str]) -> tuple[list[Proc], list[str]]:
    hosts: list[Proc] = []
    addresses: list[str] = []
    for h in range(0, n, PER_HOST):
        count = min(PER_HOST, n - h)
        argv = [sys.executable, __file__, "--serve", str(count), "--model", MODEL]
        proc = launch(f"sims-{h // PER_HOST}", argv, tmp, env, timeout=120)
        hosts.append(proc)
        addresses += [f"127.0.0.1:{p}" for p in proc.info["ports"]]
    return hosts, addresses


def start_real_proxies(
    tmp: Path, n: int, env: dict[str, str]
) -> tuple[list[Proc], list[str], list[Proc]]:
    from vs_smg import start_fake_engine

    engine, url = start_fake_engine(tmp, 16)
    spawned = []
    for rank in range(n):
        name = f"proxy-{rank}"
        ready = tmp / f"{name}.ready.json"
        argv = [
            "areal-proxy",
            *("--engine-url", url, "--model", MODEL, "--proxy-id", name, "--port", "0"),
            *("--tokenizer-path", str(ROOT / "models" / MODEL), "--log-level", "warning"),
            *("--db-path", str(tmp / f"{name}.sqlite"), "--ready-file", str(ready)),
        ]
        popen, comp = supervisor.spawn(name, argv, tmp / f"{name}.log", env=env)
        spawned.append((popen, comp, ready))
    procs: list[Proc] = []
    for popen, comp, ready in spawned:
        supervisor.wait_ready(
            popen,
            comp,
            lambda r=ready, p=popen: (supervisor.read_ready_file(r) or {}).get("pid") == p.pid,
            300,
        )
        info = supervisor.read_ready_file(ready) or {}
        comp.host, comp.port = info["host"], info["port"]
        procs.append(Proc(comp, popen, info))
    return procs, [p.address for p in procs], [engine]


async def route_times(router: str, token: str, n: int, policy: str) -> list[float]:
    from areal_proto.router.v1 import router_pb2, router_pb2_grpc

    md = (("x-areal-internal-token", token),)
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.RouteRequest(model=MODEL, policy=policy)
        for _ in range(50):
            await stub.Route(req, metadata=md)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await stub.Route(req, metadata=md)
            out.append(time.perf_counter() - t0)
    return out


async def dead_to_unroutable(router: str, token: str, dead: str, kill, limit: float) -> float:
    """Kill one proxy, then Route (round robin over every proxy, one call at a time) until
    two full turns in a row have not named it; seconds from the kill to the last call that
    still named it (0: none did)."""
    from areal_proto.router.v1 import router_pb2, router_pb2_grpc

    md = (("x-areal-internal-token", token),)
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.RouteRequest(model=MODEL, policy="round_robin")
        listing = await stub.ListProxies(router_pb2.ListProxiesRequest(model=MODEL), metadata=md)
        n = len(listing.proxies)
        kill()
        t0 = time.perf_counter()
        last = 0.0
        clean = 0
        while clean < 2 * n and time.perf_counter() - t0 < limit:
            try:
                r = await stub.Route(req, metadata=md)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:  # no healthy proxy left
                    raise
                await asyncio.sleep(0.001)
                clean += 1
                continue
            if r.address == dead:
                last = time.perf_counter() - t0
                clean = 0
            else:
                clean += 1
        return last


def measure(n: int, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"areal-scale-{n}-"))
    token = os.urandom(16).hex()
    env = {"AREAL_INTERNAL_TOKEN": token, "AREAL_ADMIN_API_KEY": ADMIN_KEY}
    started: list[Proc] = []
    try:
        router, gateway = start_router_gateway(tmp, env, args.router_args.split())
        started += [gateway, router]
        if args.real:
            proxies, addresses, extra = start_real_proxies(tmp, n, env)
        else:
            proxies, addresses = start_sim_hosts(tmp, n, env)
            extra = []
        started = [*proxies, *extra, *started]
        body = {
            "name": MODEL,
            "kind": "internal",
            "proxies": [{"proxy_id": f"p{i}", "address": a} for i, a in enumerate(addresses)],
        }
        url = f"http://{gateway.info['host']}:{gateway.info['port']}"
        cpu0 = {"router": cpu_s(router.popen.pid), "gateway": cpu_s(gateway.popen.pid)}
        t0 = time.perf_counter()
        r = httpx.post(
            url + "/admin/models",
            json=body,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=600,
        )
        register_s = time.perf_counter() - t0
        register_cpu = {
            "router": cpu_s(router.popen.pid) - cpu0["router"],
            "gateway": cpu_s(gateway.popen.pid) - cpu0["gateway"],
        }
        assert r.status_code == 201, r.text[:500]
        time.sleep(args.settle)
        pid = router.popen.pid
        c0, w0 = cpu_s(pid), time.perf_counter()
        time.sleep(args.window)
        idle = 100 * (cpu_s(pid) - c0) / (time.perf_counter() - w0)
        b0 = route_buckets(router)
        times = asyncio.run(route_times(router.address, token, args.routes, "least_loaded"))
        b1 = route_buckets(router)
        q = statistics.quantiles(times, n=100)
        row = {
            "n": n,
            "real": bool(args.real),
            "register_s": register_s,
            "register_cpu_s": register_cpu,
            "router_idle_cpu_pct": idle,
            "route_p50_ms": 1000 * statistics.median(times),
            "route_p99_ms": 1000 * q[98],
            "decision_p50_le_ms": 1000 * bucket_quantile(b0, b1, 0.5),
            "decision_p99_le_ms": 1000 * bucket_quantile(b0, b1, 0.99),
            "gateway_rss_mb": rss_mb(gateway.popen.pid),
            "router_rss_mb": rss_mb(pid),
        }
        if not args.real:
            host = proxies[0].popen
            row["dead_to_unroutable_s"] = asyncio.run(
                dead_to_unroutable(
                    router.address,
                    token,
                    addresses[0],
                    lambda: host.send_signal(signal.SIGUSR1),
                    10.0,
                )
            )
        print(json.dumps(row), flush=True)
        return row
    finally:
        supervisor.terminate(
            [[p.comp] for p in started],
            grace=5,
            procs={p.popen.pid: p.popen for p in started},
        )


def table(rows: list[dict]) -> str:
    out = [
        "| N | proxies | register (s) | router idle CPU | Route RPC p50 / p99 (ms)"
        " | decision p50 / p99 (ms, at most) | dead -> unroutable | gateway RSS | router RSS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        dead = r.get("dead_to_unroutable_s")
        out.append(
            f"| {r['n']:,} | {'real' if r['real'] else 'simulated'} | {r['register_s']:.2f} |"
            f" {r['router_idle_cpu_pct']:.1f} % | {r['route_p50_ms']:.2f} / {r['route_p99_ms']:.2f}"
            f" | {r['decision_p50_le_ms']:g} / {r['decision_p99_le_ms']:g}"
            f" | {'' if dead is None else f'{1000 * dead:.0f} ms'} | {r['gateway_rss_mb']:.0f} MB"
            f" | {r['router_rss_mb']:.0f} MB |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,256,1000")
    ap.add_argument("--real", type=int, default=0, help="N real proxies (one run) instead")
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--routes", type=int, default=2000)
    ap.add_argument("--json", default="")
    ap.add_argument("--router-args", default="", help="more router flags, e.g. '--policy x'")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve_sims(args.serve, args.model, args.ready_file))
        return
    sizes = [args.real] if args.real else [int(s) for s in args.sizes.split(",")]
    rows = [measure(n, args) for n in sizes]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
