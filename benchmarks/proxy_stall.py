"""Does one huge request stall a data proxy? Small-request latency beside 7 MB prompts.

    uv run python benchmarks/proxy_stall.py [--big-mb 7] [--big 3] [--quiet-s 8] \
        [--loaded-s 20] [--context-lengths 0,1000000] [--no-control]

A real router, gateway and one data proxy (through tests/e2e/stack.py, the code the CLI uses
to spawn components) in front of the *zero-cost fake engine* (benchmarks/fake_engine.py), so
everything measured is areal's own. Per scenario (one proxy `--context-length` each; 0 = the
model's 2048):

1. quiet: small chats (admin key, "Hi", 16 tokens) one at a time through the gateway for
   `--quiet-s`, their p50/p99/max;
2. control (unless `--no-control`): the same small chats for `--quiet-s` beside one busy
   loop in Linux's idle scheduling class at `nice` 10, a process that does none of areal's
   work. It is the least any CPU-heavy work costs the small chats on this machine: the
   prompt screens run at exactly that priority, so a loaded phase whose p99 is near this
   phase's pays for the CPU being busy, not for areal stalling;
3. loaded: the same small chats while `--big` requests, each a chat body of `--big-mb` MB
   (one user message of random words, under the gateway's 8 MiB limit) with a session key,
   run concurrently and again as each finishes, for at least `--loaded-s` and until each was
   answered once.

Meanwhile the router's view of the proxy (`GET /admin/workers`) is read every 0.2 s: the
`unhealthy` column counts reads that saw it UNHEALTHY; and the proxy's own `GetStats` (what
the router polls) is timed straight to the proxy every 0.1 s; `CPU gw/proxy` is the share of
one core the gateway and the proxy used over the phase. With the model's 2048-token
context a 7 MB prompt cannot fit and should be refused at once; with `--context-length
1000000` no cheap bound can refuse it (7 M characters / 13 bytes at most per token of this
vocabulary is ~540 k tokens), so it is tokenized in full (5.8 M tokens) before it is refused:
that is the CPU-heavy work that must not run on the loop that serves the others.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc  # noqa: E402

SMALL = orjson.dumps(
    {"model": "tiny-parrot", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
)


def big_body(mb: float) -> bytes:
    rnd = random.Random(0)
    words = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(5000)]
    n = int(mb * 1_000_000)
    text = " ".join(rnd.choices(words, k=n // 5))[: n - 100]
    return orjson.dumps(
        {
            "model": "tiny-parrot",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 16,
        }
    )


# The control phase's busy loop: idle class, nice 10, as the screens' children run.
_IDLE_BURNER = (
    "import os\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "os.nice(10)\n"
    "while True:\n"
    "    pass\n"
)


def cpu_seconds(pid: int) -> float:
    """Seconds of CPU (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _q(lat: list[float]) -> tuple[float, float, float]:
    if not lat:
        return (0.0, 0.0, 0.0)
    if len(lat) == 1:
        return (lat[0], lat[0], lat[0])
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return (q[49] * 1e3, q[98] * 1e3, max(lat) * 1e3)


async def _send_big(
    gateway: str, keys: list[str], big: bytes, stop: Any, answered: Any
) -> list[tuple[int, float, str]]:
    """Each key's big chat again as soon as it is answered, until `stop`."""
    bigs: list[tuple[int, float, str]] = []
    left = set(keys)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def heavy(key: str) -> None:
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            while not stop.is_set():
                t0 = time.perf_counter()
                async with http.post(
                    gateway + "/v1/chat/completions", data=big, headers=headers
                ) as r:
                    text = await r.read()
                    code = ""
                    if r.status != 200:
                        code = (orjson.loads(text).get("error") or {}).get("code") or ""
                    bigs.append((r.status, time.perf_counter() - t0, code))
                left.discard(key)
                if not left:
                    answered.set()

        await asyncio.gather(*(heavy(k) for k in keys))
    return bigs


def _sender_main(gateway: str, keys: list[str], big: bytes, stop: Any, answered: Any, out: Any):
    t0 = time.process_time()
    bigs = asyncio.run(_send_big(gateway, keys, big, stop, answered))
    out.put((bigs, time.process_time() - t0))


class _Senders:
    """The big requests' client, in a process of its own."""

    def __init__(self, gateway: str, keys: list[str], big: bytes) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.answered = ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(
            target=_sender_main,
            args=(gateway, keys, big, self.stop, self.answered, self._out),
            daemon=True,
        )
        self._proc.start()

    def results(self) -> tuple[list[tuple[int, float, str]], float]:
        got = self._out.get(timeout=900)
        self._proc.join(timeout=30)
        return got


async def phase(
    gateway: str, seconds: float, keys: list[str], big: bytes | None, proxy: tuple[str, str]
) -> dict[str, object]:
    """Small chats one at a time for `seconds` (and, with `big`, until each key's big request
    was answered once), the router's health reads, the big requests' outcomes."""
    small_lat: list[float] = []
    small_err = 0
    unhealthy = 0
    reads = 0
    bigs: list[tuple[int, float, str]] = []
    stats_lat: list[float] = []
    sender_cpu = 0.0
    stop = asyncio.Event()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def small() -> None:
            nonlocal small_err
            while not stop.is_set():
                t0 = time.perf_counter()
                async with http.post(
                    gateway + "/v1/chat/completions", data=SMALL, headers=admin
                ) as r:
                    await r.read()
                    if r.status != 200:
                        small_err += 1
                        continue
                small_lat.append(time.perf_counter() - t0)

        async def poll() -> None:
            nonlocal unhealthy, reads
            while not stop.is_set():
                async with http.get(gateway + "/admin/workers", headers=admin) as r:
                    ws = (await r.json())["workers"]
                reads += 1
                if any("UNHEALTHY" in str(w.get("health", "")).upper() for w in ws) or not ws:
                    unhealthy += 1
                await asyncio.sleep(0.2)

        async def stats() -> None:
            # The proxy's own GetStats (what the router polls), straight to it, every 0.1 s.
            address, token = proxy
            async with grpc.aio.insecure_channel(address) as ch:
                stub = proxy_pb2_grpc.ProxyStatusServiceStub(ch)
                md = (("x-areal-internal-token", token),)
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await stub.GetStats(proxy_pb2.GetStatsRequest(), metadata=md, timeout=60)
                    stats_lat.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.1)

        # The big requests come from another process: sent from this one they would share
        # the loop that times the small chats (18 bodies of 7 MB a second when each is refused
        # at once), and the client's own sends would be measured as the stack's latency.
        senders = None
        if big is not None:
            senders = _Senders(gateway, keys, big)
        tasks = [asyncio.ensure_future(t()) for t in (small, poll, stats)]
        await asyncio.sleep(seconds)
        if senders is not None:
            await asyncio.to_thread(senders.answered.wait)
            senders.stop.set()
            bigs, sender_cpu = await asyncio.to_thread(senders.results)
        stop.set()
        await asyncio.gather(*tasks)
    p50, p99, mx = _q(small_lat)
    s50, s99, smx = _q(stats_lat)
    return {
        "stats": (s50, s99, smx),
        "n": len(small_lat),
        "err": small_err,
        "p50": p50,
        "p99": p99,
        "max": mx,
        "unhealthy": unhealthy,
        "reads": reads,
        "bigs": bigs,
        "sender_cpu": sender_cpu,
    }


def scenario(tmp: Path, engine_url: str, ctx: int, args: argparse.Namespace, big: bytes) -> list:
    proxy_args = ["--log-level", "warning"]
    if ctx:
        proxy_args += ["--context-length", str(ctx)]
    stack = start_stack(
        tmp / f"ctx{ctx}",
        engine_url,
        ROOT / "models" / "tiny-parrot",
        n_proxies=1,
        gateway_args=["--log-level", "warning"],
        proxy_args=proxy_args,
        router_args=["--log-level", "warning"],
    )
    try:
        with stack.admin() as c:
            g = c.post(
                "/rl/start_session", json={"task_id": "stall", "group_size": args.big}
            ).json()
        keys = [s["session_api_key"] for s in g["sessions"]]
        proxy = (stack.proxies[0].address, stack.env["AREAL_INTERNAL_TOKEN"])
        pids = {"gateway": stack.gateway.popen.pid, "proxy": stack.proxies[0].popen.pid}
        out = []
        phases = [("quiet", [], None, args.quiet_s)]
        if args.control:
            phases.append(("control", [], None, args.quiet_s))
        phases.append(("loaded", keys, big, args.loaded_s))
        for name, keys_, big_, secs in phases:
            before = {k: cpu_seconds(pid) for k, pid in pids.items()}
            burner = None
            if name == "control":
                burner = subprocess.Popen([sys.executable, "-c", _IDLE_BURNER])
            t0 = time.perf_counter()
            try:
                r = asyncio.run(phase(stack.gateway_url, secs, keys_, big_, proxy))
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
            wall = time.perf_counter() - t0
            r["name"] = name
            # Share of one core each process used over the phase.
            r["cpu"] = {k: (cpu_seconds(pid) - before[k]) / wall for k, pid in pids.items()}
            r["cpu"]["senders"] = r["sender_cpu"] / wall
            out.append(r)
        return out
    finally:
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=float, default=7.0)
    ap.add_argument("--big", type=int, default=3, help="concurrent big requests")
    ap.add_argument("--quiet-s", type=float, default=8.0)
    ap.add_argument("--loaded-s", type=float, default=20.0)
    ap.add_argument("--context-lengths", default="0,1000000")
    ap.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the phase beside an idle-class busy loop",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="areal-stall-"))
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    engine_url = f"http://127.0.0.1:{engine.info['port']}"
    big = big_body(args.big_mb)
    results = []
    try:
        for ctx in (int(x) for x in args.context_lengths.split(",")):
            results.append((ctx, scenario(tmp, engine_url, ctx, args, big)))
    finally:
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    print(
        f"\nsmall chats (c=1, through gateway -> one proxy, zero-cost fake engine) beside "
        f"{args.big} concurrent {len(big) / 1e6:.1f} MB session-key chats; latencies in ms"
    )
    hdr = (
        f"{'context':>9} {'phase':<7} | {'n':>5} {'err':>4} {'p50':>8} {'p99':>8} {'max':>8} | "
        f"{'unhealthy':>9} | {'GetStats p50':>12} {'p99':>7} {'max':>7} | {'CPU gw/proxy/big client':>23} | "
        "big requests: status x count (mean s, code)"
    )
    print(hdr)
    print("-" * len(hdr))
    for ctx, phases in results:
        for r in phases:
            name = r["name"]
            st = r["stats"]
            by: dict[tuple[int, str], list[float]] = {}
            for status, secs, code in r["bigs"]:  # type: ignore[attr-defined]
                by.setdefault((status, code), []).append(secs)
            bigs = ", ".join(
                f"{s} x{len(v)} ({statistics.mean(v):.2f} s{', ' + c if c else ''})"
                for (s, c), v in sorted(by.items())
            )
            print(
                f"{ctx or 2048:>9} {name:<7} | {r['n']:>5} {r['err']:>4} {r['p50']:>8.2f} "
                f"{r['p99']:>8.2f} {r['max']:>8.1f} | {r['unhealthy']:>4}/{r['reads']:<4} | "
                f"{st[0]:>12.2f} {st[1]:>7.2f} {st[2]:>7.1f} | "
                f"{r['cpu']['gateway']:>7.2f}/{r['cpu']['proxy']:.2f}/{r['cpu']['senders']:<7.2f} | {bigs}"
            )
        by_name = {r["name"]: r for r in phases}
        loaded = by_name["loaded"]
        for base in ("quiet", "control"):
            if base in by_name and by_name[base]["p99"]:
                ratio = loaded["p99"] / by_name[base]["p99"]
                print(f"{'':>9} loaded p99 / {base} p99 = {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
