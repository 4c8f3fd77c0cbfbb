"""Throughput with 1 and 2 gateways on one port (SO_REUSEPORT), in the same run.

    uv run python benchmarks/gateways.py [--requests 3000] [--rounds 2]

One zero-cost fake engine (benchmarks/fake_engine.py), a real router and two real data proxies
in front of it (registered as one model; two so the proxy is not the only bottleneck), started
as the CLI starts them (tests/e2e/stack.py). Against that one back end:

* config A: one gateway, `--reuse-port --own-port 0`, on port P;
* config B: two gateways, both `--reuse-port --own-port 0`, sharing port Q.

For each, `c` chat completions in flight (non-stream and stream) from one aiohttp client. A
keep-alive connection stays on the gateway the kernel gave it when it opened, so the client
asks the server to close every `--requests-per-connection`-th request's connection: the pool
keeps reopening connections, and SO_REUSEPORT deals each new one out afresh. Each gateway's
share is read from its own `/metrics` on its own port. CPU is read from /proc/<pid>/stat.

All of it (client, gateways, router, proxies, engine) shares this machine's cores, so with
2 cores the B/A ratio is a floor, not a scaling curve; the number that carries over is the
gateway's CPU per request: one core serves about 1000 / (gateway CPU ms per request) req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, Proc, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

MODEL = "tiny-parrot"
N_PROXIES = 2
FLOOR_NOTE = (
    "client, gateway(s), router, proxies and engine share this machine's {cores} cores: B/A is "
    "a floor, not a scaling curve. Capacity per core ~= 1000 / (gateway CPU ms per request) req/s."
)


@dataclass
class Gateway:
    proc: Proc

    @property
    def pid(self) -> int:
        return self.proc.popen.pid

    @property
    def own_url(self) -> str:
        return f"http://127.0.0.1:{self.proc.info['own_port']}"


def cpu_seconds(pid: int) -> float:
    """Seconds of CPU (user + system) the process has used, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


async def served(http: aiohttp.ClientSession, gw: Gateway) -> float:
    """Chat requests this gateway has answered, from its own /metrics (its own port)."""
    async with http.get(gw.own_url + "/metrics") as r:
        r.raise_for_status()
        body = await r.text()
    total = 0.0
    for line in body.splitlines():
        if line.startswith("areal_gateway_requests_total{") and 'endpoint="chat"' in line:
            total += float(line.rpartition(" ")[2])
    return total


async def run_load(url: str, body: bytes, n: int, conc: int, stream: bool, per_conn: int) -> dict:
    lat: list[float] = []
    errors: dict[str, int] = {}
    sem = asyncio.Semaphore(conc)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}
    closing = {**headers, "Connection": "close"}
    count = 0
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def one() -> None:
            nonlocal count
            async with sem:
                count += 1
                # Every per_conn-th request closes its connection: the next one opens anew
                # and the kernel picks a gateway for it (SO_REUSEPORT hashes each new one).
                h = closing if per_conn and count % per_conn == 0 else headers
                t0 = time.perf_counter()
                async with http.post(url, data=body, headers=h) as r:
                    if r.status != 200:
                        key = f"{r.status} {(await r.read())[:160].decode(errors='replace')}"
                        errors[key] = errors.get(key, 0) + 1
                        return
                    if stream:
                        async for _line in r.content:
                            pass
                    else:
                        await r.read()
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(min(200, n))))  # warm-up, opens the pool
        lat.clear()
        errors.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
    return {
        "rps": len(lat) / wall,
        "p50": q[49] * 1e3,
        "p99": q[98] * 1e3,
        "ok": len(lat),
        "errors": errors,
        "wall": wall,
    }


async def measure(
    url: str,
    gateways: list[Gateway],
    others: dict[str, list[int]],
    body: bytes,
    args: argparse.Namespace,
    stream: bool,
) -> dict:
    async with aiohttp.ClientSession() as http:
        seen0 = [await served(http, g) for g in gateways]
    # CPU and served counts both cover run_load's warm-up too, so their ratio stays per request.
    gw0 = [cpu_seconds(g.pid) for g in gateways]
    oth0 = {k: sum(cpu_seconds(p) for p in pids) for k, pids in others.items()}
    me0 = time.process_time()
    busy0, tot0 = machine_busy()
    res = await run_load(url, body, args.requests, args.concurrency, stream, args.per_conn)
    busy1, tot1 = machine_busy()
    me1 = time.process_time()
    gw1 = [cpu_seconds(g.pid) for g in gateways]
    oth1 = {k: sum(cpu_seconds(p) for p in pids) for k, pids in others.items()}
    async with aiohttp.ClientSession() as http:
        seen1 = [await served(http, g) for g in gateways]
    total = sum(seen1) - sum(seen0)  # warm-up + measured requests, what the CPU deltas cover
    res["per_gateway"] = [
        {
            "served": s1 - s0,
            "share": (s1 - s0) / total if total else 0.0,
            "cpu_ms": (c1 - c0) / (s1 - s0) * 1e3 if s1 > s0 else float("nan"),
        }
        for s0, s1, c0, c1 in zip(seen0, seen1, gw0, gw1, strict=True)
    ]
    res["gateway_cpu_ms"] = (sum(gw1) - sum(gw0)) / total * 1e3 if total else float("nan")
    res["other_cpu_ms"] = {k: (oth1[k] - oth0[k]) / total * 1e3 for k in others}
    res["client_cpu_ms"] = (me1 - me0) / total * 1e3 if total else float("nan")
    res["busy"] = (busy1 - busy0) / (tot1 - tot0) if tot1 > tot0 else 0.0
    return res


def start_gateway(name: str, port: int, router_addr: str, tmp: Path, env: dict) -> Gateway:
    argv = ["areal-gateway", "--port", str(port), "--router-addr", router_addr]
    argv += ["--reuse-port", "--own-port", "0", "--log-level", "warning"]
    return Gateway(launch(name, argv, tmp, env))


def stop(procs: list[Proc]) -> None:
    supervisor.terminate(
        [[p.comp] for p in procs], grace=3, procs={p.popen.pid: p.popen for p in procs}
    )


def _interrupt(_signum: int, _frame: object) -> None:
    # Raised wherever the loop is, so the finally block that stops every process runs. (Under
    # asyncio.run's own SIGINT handler the first Ctrl-C only cancels the running task, which
    # the HTTP client can absorb, and the benchmark went on.) The tasks it leaves behind are
    # of no interest: keep asyncio from logging each of them.
    logging.getLogger("asyncio").disabled = True
    raise KeyboardInterrupt


def report(results: dict, args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 0
    print(
        f"\nareal gateways: 1 vs 2 on one port (SO_REUSEPORT), zero-cost fake engine, "
        f"{N_PROXIES} proxies, round robin; c={args.concurrency}, {args.requests} chat "
        f"requests per row, a new connection every {args.per_conn} requests; latencies in ms; "
        f"CPU in ms per request (/proc/<pid>/stat; warm-up included)\n"
    )
    print(FLOOR_NOTE.format(cores=cores) + "\n")
    hdr = (
        f"{'mode':<11}{'cfg':>4}{'rnd':>4} | {'req/s':>6} {'p50':>6} {'p99':>6} {'err':>4} | "
        f"{'per gateway: share, CPU ms/req':<32}| {'gw':>5} {'router':>6} {'proxies':>7} "
        f"{'engine':>6} {'client':>6} | {'busy':>4}"
    )
    print(hdr)
    print("-" * len(hdr))
    for (mode, cfg, rnd), r in results.items():
        gws = ", ".join(f"{g['share'] * 100:.0f}% {g['cpu_ms']:.3f}" for g in r["per_gateway"])
        o = r["other_cpu_ms"]
        print(
            f"{mode:<11}{cfg:>4}{rnd:>4} | {r['rps']:>6.0f} {r['p50']:>6.1f} {r['p99']:>6.1f} "
            f"{sum(r['errors'].values()):>4} | {gws:<32}| {r['gateway_cpu_ms']:>5.3f} "
            f"{o['router']:>6.3f} {o['proxies']:>7.3f} {o['engine']:>6.3f} "
            f"{r['client_cpu_ms']:>6.3f} | {r['busy'] * 100:>3.0f}%"
        )
        for kind, count in r["errors"].items():
            print(f"{'':<19} {count} x {kind}")
    print("\nsummary (mean over rounds)\n")
    for mode in dict.fromkeys(m for m, _, _ in results):
        rps = {
            c: statistics.mean(
                r["rps"] for (m, cf, _), r in results.items() if (m, cf) == (mode, c)
            )
            for c in ("A", "B")
        }
        gw_ms = {
            c: statistics.mean(
                r["gateway_cpu_ms"] for (m, cf, _), r in results.items() if (m, cf) == (mode, c)
            )
            for c in ("A", "B")
        }
        print(
            f"{mode:<11} req/s A {rps['A']:.0f}, B {rps['B']:.0f}, B/A {rps['B'] / rps['A']:.2f}; "
            f"gateway CPU ms/req A {gw_ms['A']:.3f}, B {gw_ms['B']:.3f} -> capacity per core "
            f"~{1000 / gw_ms['A']:.0f} (A), ~{1000 / gw_ms['B']:.0f} (B) req/s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="measured requests per row")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=2, help="A,B then B,A, ... alternating")
    ap.add_argument(
        "--requests-per-connection",
        dest="per_conn",
        type=int,
        default=20,
        help="the client closes a connection after about this many requests (0: never)",
    )
    args = ap.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="areal-bench-gws-"))
    engine = launch(
        "fake-engine",
        [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py"), "--tokens", str(args.tokens)],
        tmp,
        {},
    )
    extra: list[Proc] = []
    stack = None
    try:
        # The stack's own gateway is config A's (it also registers the model for all).
        stack = start_stack(
            tmp,
            f"http://127.0.0.1:{engine.info['port']}",
            ROOT / "models" / MODEL,
            n_proxies=N_PROXIES,
            gateway_args=["--reuse-port", "--own-port", "0", "--log-level", "warning"],
            proxy_args=["--log-level", "warning"],
            router_args=["--log-level", "warning"],
        )
        a = Gateway(stack.gateway)
        b1 = start_gateway("gateway-b1", 0, stack.router.address, tmp, stack.env)
        extra.append(b1.proc)
        q = b1.proc.info["port"]
        b2 = start_gateway("gateway-b2", q, stack.router.address, tmp, stack.env)
        extra.append(b2.proc)
        configs = {
            "A": (stack.gateway_url, [a]),
            "B": (f"http://127.0.0.1:{q}", [b1, b2]),
        }
        others = {
            "router": [stack.router.popen.pid],
            "proxies": [p.popen.pid for p in stack.proxies],
            "engine": [engine.popen.pid],
        }
        results: dict[tuple[str, str, int], dict] = {}
        for stream in (False, True):
            mode = "stream" if stream else "non-stream"
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Say something back."}],
                    "max_tokens": args.tokens,
                    "temperature": 0,
                    "stream": stream,
                }
            )
            for rnd in range(1, args.rounds + 1):
                for cfg in ("A", "B") if rnd % 2 else ("B", "A"):
                    url, gws = configs[cfg]
                    results[(mode, cfg, rnd)] = asyncio.run(
                        measure(url + "/v1/chat/completions", gws, others, body, args, stream)
                    )
        report(results, args)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup
            signal.signal(sig, signal.SIG_IGN)
        stop(extra)
        if stack is not None:
            stack.stop(grace=3)
        stop([engine])
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("interrupted: every process stopped", file=sys.stderr)
        raise SystemExit(130) from None
