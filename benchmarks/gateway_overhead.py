"""Overhead of the areal path (gateway -> router -> proxy) over calling the engine directly.

    uv run python benchmarks/gateway_overhead.py [--requests 2000] [--tokens 16]

The engine is the *zero-cost fake engine* (benchmarks/fake_engine.py): it
answers instantly, so every millisecond measured through the gateway is
areal's own. Client, gateway, router, proxy and engine share this machine's
cores. Prints one table: engine direct vs through the gateway, same prompt
ids, at concurrency 1 and 64, non-stream and stream, with ratios; then the CPU
each areal process spent per request. The zero-cost engine writes a whole
stream at once, which lets areal pass chunks that arrived together in one
message; the `stream@Nms` rows pace its tokens N ms apart (one per decode
step, as a real engine), where every chunk travels alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

PROMPT_IDS = [42, 367, 81, 442, 267, 428, 78, 100, 200, 300, 17, 19, 23, 29, 31, 37]


async def run_load(url: str, body: bytes, headers: dict, n: int, conc: int, stream: bool) -> dict:
    lat: list[float] = []
    ttft: list[float] = []
    gaps: list[float] = []
    errors = 0
    kinds: dict[str, int] = {}
    sem = asyncio.Semaphore(conc)
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn, headers=headers) as http:

        async def one() -> None:
            nonlocal errors
            async with sem:
                t0 = time.perf_counter()
                async with http.post(url, data=body) as r:
                    if r.status != 200:
                        errors += 1
                        text = (await r.read())[:200].decode(errors="replace")
                        kinds[f"{r.status} {text}"] = kinds.get(f"{r.status} {text}", 0) + 1
                        return
                    if not stream:
                        await r.read()
                    else:
                        first = None
                        prev = None
                        async for line in r.content:
                            if not line.startswith(b"data:"):
                                continue
                            now = time.perf_counter()
                            if first is None:
                                first = now
                                ttft.append(now - t0)
                            elif prev is not None:
                                gaps.append(now - prev)
                            prev = now
                lat.append(time.perf_counter() - t0)

        # warm-up, then the measured run
        await asyncio.gather(*(one() for _ in range(min(50, n))))
        lat.clear(), ttft.clear(), gaps.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    out = {
        "p50": q[49] * 1e3,
        "p99": q[98] * 1e3,
        "rps": len(lat) / wall,
        "errors": errors,
        "error_kinds": kinds,
        "n": n,
    }
    if stream and ttft:
        out["ttft_p50"] = statistics.median(ttft) * 1e3
        out["gap_p50"] = statistics.median(gaps) * 1e3 if gaps else 0.0
    return out


def cpu_seconds(pid: int) -> float:
    """Seconds of CPU (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _pace(engine_url: str, interval_ms: float) -> None:
    async def post() -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.post(engine_url + "/fake_config", json={"token_interval_ms": interval_ms}) as r,
        ):
            r.raise_for_status()

    asyncio.run(post())


def _row(mode: str, conc: int, e: dict, g: dict) -> str:
    return (
        f"{mode:<11}{conc:>4} | {e['p50']:>8.2f} {e['p99']:>7.2f} {e['rps']:>7.0f} | "
        f"{g['p50']:>8.2f} {g['p99']:>7.2f} {g['rps']:>7.0f} | "
        f"{g['p50'] - e['p50']:>8.2f} {g['p99'] - e['p99']:>8.2f} {g['rps'] / e['rps']:>6.2f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--paced-ms",
        type=float,
        default=2.0,
        help="token interval of the paced stream rows (0: leave them out)",
    )
    ap.add_argument(
        "--no-compare",
        action="store_true",
        help="leave out the second gateway that makes one gRPC call per request",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="areal-bench-"))
    engine = launch(
        "fake-engine",
        [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py"), "--tokens", str(args.tokens)],
        tmp,
        {},
    )
    engine_url = f"http://127.0.0.1:{engine.info['port']}"
    try:
        stack = start_stack(
            tmp,
            engine_url,
            ROOT / "models" / "tiny-parrot",
            n_proxies=1,
            gateway_args=["--log-level", "warning"],
            proxy_args=["--log-level", "warning"],
            router_args=["--log-level", "warning"],
        )
    except BaseException:  # the engine would outlive a stack that failed to start
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
        raise
    # The same router and proxy behind a second gateway that makes one gRPC call per request
    # (--no-proxy-streams): the multiplexed stream's effect, measured in the same run.
    gateways = {"streams": (stack.gateway_url, stack.gateway.popen.pid)}
    calls = None
    if not args.no_compare:
        calls = launch(
            "gateway-calls",
            [
                "areal-gateway",
                "--port",
                "0",
                "--router-addr",
                stack.router.address,
                "--log-level",
                "warning",
                "--no-proxy-streams",
            ],
            tmp,
            stack.env,
        )
        gateways["calls"] = (f"http://127.0.0.1:{calls.info['port']}", calls.popen.pid)
    try:
        direct = {"Content-Type": "application/json"}
        via = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}
        others = {"proxy": stack.proxies[0].popen.pid, "router": stack.router.popen.pid}
        rows: dict[str, list] = {name: [] for name in gateways}
        modes = [("non-stream", False, 0.0), ("stream", True, 0.0)]
        if args.paced_ms > 0:
            modes.append((f"stream@{args.paced_ms:g}ms", True, args.paced_ms))
        for mode, stream, interval in modes:
            _pace(engine_url, interval)
            eng_body = orjson.dumps(
                {
                    "input_ids": PROMPT_IDS,
                    "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0},
                    "return_logprob": True,
                    "stream": stream,
                }
            )
            gw_body = orjson.dumps(
                {
                    "model": "tiny-parrot",
                    "prompt": PROMPT_IDS,
                    "max_tokens": args.tokens,
                    "temperature": 0,
                    "stream": stream,
                }
            )
            for conc in (1, 64):
                n = args.requests if conc > 1 else args.requests // 2
                if interval:  # paced requests take tokens x interval: keep the run short
                    n = min(n, 500 if conc > 1 else 100)
                e = asyncio.run(
                    run_load(engine_url + "/generate", eng_body, direct, n, conc, stream)
                )
                for name, (url, gw_pid) in gateways.items():
                    pids = {"gateway": gw_pid, **others}
                    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                    g = asyncio.run(
                        run_load(url + "/v1/completions", gw_body, via, n, conc, stream)
                    )
                    g["cpu_ms"] = {
                        k: (cpu_seconds(pid) - before[k]) / g["n"] * 1e3 for k, pid in pids.items()
                    }
                    rows[name].append((mode, conc, e, g))
        _pace(engine_url, 0.0)
        print(
            f"\nareal gateway overhead vs zero-cost fake engine ({args.tokens} tokens/request, "
            f"{args.requests} requests at c=64, half at c=1; paced rows fewer; "
            f"all processes on this machine; latencies in ms)"
        )
        for name in gateways:
            what = (
                "one multiplexed Generate stream per proxy (the default)"
                if name == "streams"
                else "one gRPC call per request (--no-proxy-streams)"
            )
            print(f"\ngateway -> proxy: {what}\n")
            hdr = (
                f"{'mode':<11}{'c':>4} | {'engine':>8} {'p99':>7} {'req/s':>7} | "
                f"{'gateway':>8} {'p99':>7} {'req/s':>7} | {'added':>8} {'added99':>8} {'ratio':>6}"
            )
            print(hdr)
            print("-" * len(hdr))
            for mode, conc, e, g in rows[name]:
                print(_row(mode, conc, e, g))
                if mode.startswith("stream"):
                    print(
                        f"{'':<15} | ttft p50 {e.get('ttft_p50', 0):.2f}, gap p50 "
                        f"{e.get('gap_p50', 0):.3f} | ttft p50 {g.get('ttft_p50', 0):.2f}, "
                        f"gap p50 {g.get('gap_p50', 0):.3f}"
                    )
                if e["errors"] or g["errors"]:
                    print(f"{'':<15} errors: engine {e['errors']}, gateway {g['errors']}")
                    for kind, count in {
                        **e.get("error_kinds", {}),
                        **g.get("error_kinds", {}),
                    }.items():
                        print(f"{'':<17} {count} x {kind}")
        print("\nCPU per request through the gateway (ms, from /proc/<pid>/stat over each run)\n")
        names = list(gateways)
        print(
            f"{'mode':<15}{'c':>4} | "
            + " | ".join(
                f"{n + ': gateway':>16} {'proxy':>6} {'router':>6} {'areal':>6}" for n in names
            )
            + (" | areal ratio" if len(names) == 2 else "")
        )
        for i, (mode, conc, _e, _g) in enumerate(rows[names[0]]):
            cells, totals = [], []
            for n in names:
                c = rows[n][i][3]["cpu_ms"]
                totals.append(sum(c.values()))
                cells.append(
                    f"{c['gateway']:>16.3f} {c['proxy']:>6.3f} {c['router']:>6.3f} {totals[-1]:>6.3f}"
                )
            ratio = f" | {totals[0] / totals[1]:>11.2f}" if len(totals) == 2 and totals[1] else ""
            print(f"{mode:<15}{conc:>4} | " + " | ".join(cells) + ratio)
    finally:
        if calls is not None:
            supervisor.terminate([[calls.comp]], grace=2, procs={calls.popen.pid: calls.popen})
        stack.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
