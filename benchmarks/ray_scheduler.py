"""`--scheduler ray` vs `local`: start time, and the data path with the proxy on another node.

    uv run --no-sync python benchmarks/ray_scheduler.py [--repeat 1] [--requests 2000]

Runs as root (a real two-node Ray cluster in network + pid namespaces, tests/cluster/
netns_cluster.py: node i at 198.18.0.(10+i)). Two parts, one table each, with ratios:

1. start: `areal inf run ... --detach` until it returns (every component healthy), run
   inside node 1, with `--scheduler ray` (the replica placed by Ray) and `--scheduler
   local`, same model, backend and flags: the real CPU SGLang engine with tiny-parrot,
   `sglang:d1` (one engine at a time on a small machine). Each service is stopped with
   `areal inf stop` before the next starts; `--repeat N` alternates ray/local N times.
2. data path: the *zero-cost fake engine* (benchmarks/fake_engine.py) behind areal's own
   binaries, started here as the ray scheduler places them: router (127.0.0.1) and gateway
   (198.18.0.11) on node 1, under one service CA (mutual TLS, areal_cli.tls) and the
   internal token; a proxy bound to its node's address with a fake engine on that node's
   loopback, either on node 2 (remote) or on node 1 (same node); plus a plaintext stack
   (no AREAL_TLS_*, same token) all on node 1, for the cost of TLS itself. Load comes from
   node 1's namespace (the gateway at 198.18.0.11) at concurrency 1 and 32, non-stream and
   stream; CPU per request of gateway, router and proxy from /proc/<pid>/stat.

Every process this starts is stopped (by process group) and the cluster torn down, also on
Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
PARROT = ROOT / "models" / "tiny-parrot"
PROMPT_IDS = [42, 367, 81, 442, 267, 428, 78, 100, 200, 300, 17, 19, 23, 29, 31, 37]
ADMIN_KEY = "areal-ray-bench-admin-key"
CONCURRENCY = (1, 32)


def cpu_seconds(pid: int) -> float:
    """Seconds of CPU (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# ---- the load driver: runs as a child process inside node 1's network namespace ----------


async def _load(spec: dict) -> dict:
    import aiohttp

    url, body, stream = spec["url"], spec["body"].encode(), spec["stream"]
    n, conc, pids = spec["n"], spec["conc"], spec["pids"]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}
    lat: list[float] = []
    ttft: list[float] = []
    errors = 0
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
                        await r.read()
                        return
                    if not stream:
                        await r.read()
                    else:
                        first = True
                        async for line in r.content:
                            if first and line.startswith(b"data:"):
                                ttft.append(time.perf_counter() - t0)
                                first = False
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(min(100, n))))  # warm-up, not counted
        lat.clear(), ttft.clear()
        errors = 0
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        cpu = {k: (cpu_seconds(p) - before[k]) / n * 1e3 for k, p in pids.items()}
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    out = {"p50": q[49] * 1e3, "p99": q[98] * 1e3, "rps": len(lat) / wall, "errors": errors}
    out["cpu_ms"] = cpu
    if ttft:
        out["ttft_p50"] = statistics.median(ttft) * 1e3
    return out


def load_worker(spec_json: str) -> int:
    print(json.dumps(asyncio.run(_load(json.loads(spec_json)))), flush=True)
    return 0


# ---- the benchmark ------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "e2e"))
        sys.path.insert(0, str(ROOT / "tests" / "cluster"))
        from netns_cluster import NetnsCluster

        self.args = args
        self.cluster = NetnsCluster(num_nodes=2)
        self.tmp = Path(tempfile.mkdtemp(prefix="areal-raybench-"))
        self.procs: dict[str, list] = {"proxy": [], "gateway": [], "router": [], "engine": []}
        self.services: list[tuple[str, Path]] = []
        self.load: subprocess.Popen | None = None
        self.areal = shutil.which("areal")
        if not self.areal:
            raise SystemExit("the areal CLI is not on PATH (run through `uv run`)")

    # -- part 1: the CLI ------------------------------------------------------------------

    def cli(self, home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
        env = {"AREAL_HOME": str(home), "RAY_ADDRESS": self.cluster.address}
        return self.cluster.run(1, [self.areal, *args], env=env, timeout=timeout, check=False)

    def start_once(self, scheduler: str, rep: int) -> dict:
        service = f"rb{scheduler}{rep}"
        home = self.tmp / f"home-{service}"
        home.mkdir()
        sched = ["--scheduler", "ray", "--ray-address", self.cluster.address]
        if scheduler == "local":
            sched = ["--scheduler", "local"]
        self.services.append((service, home))
        t0 = time.perf_counter()
        r = self.cli(
            home,
            "inf", "run",
            "--service", service,
            *sched,
            "--host", self.cluster.ip(1),
            "--port", "18080" if scheduler == "ray" else "18081",
            "--admin-api-key", ADMIN_KEY,
            "--model", "tiny",
            "--backend", "sglang:d1",
            "--model-path", str(PARROT),
            "--proxy-args", "--chat-template-type hf",
            "--detach",
            timeout=self.args.start_timeout,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"inf run --scheduler {scheduler} failed:\n{r.stdout}{r.stderr}")
        text = r.stdout + r.stderr
        m = re.search(r"(?:replicas ready|engines healthy) after ([0-9.]+)s", text)
        t1 = time.perf_counter()
        s = self.cli(home, "inf", "stop", "--service", service, timeout=180)
        stop = time.perf_counter() - t1
        if s.returncode == 0:
            self.services.remove((service, home))
        else:
            print(f"warning: inf stop {service}: {s.stderr.strip()[-400:]}", file=sys.stderr)
        return {"wall": wall, "engine": float(m.group(1)) if m else None, "stop": stop}

    def part_start(self) -> list[tuple[str, dict, dict]]:
        rows = []
        for rep in range(1, self.args.repeat + 1):
            ray = self.start_once("ray", rep)
            local = self.start_once("local", rep)
            rows.append((f"run {rep}", ray, local))
            print(f"  [start {rep}] ray {ray['wall']:.1f}s, local {local['wall']:.1f}s", flush=True)
        return rows

    # -- part 2: the data path ------------------------------------------------------------

    def spawn(self, kind: str, name: str, node: int, argv: list[str], env: dict) -> object:
        """`argv` in node `node`'s network namespace (`ip netns exec` execs it: the pid is the
        program's own, in this pid namespace), its own process group; waits for its ready
        file (tests/e2e/stack.py's launch)."""
        from stack import launch

        ns = self.cluster.node(node).ns
        p = launch(name, ["ip", "netns", "exec", ns, *argv], self.tmp, env)
        self.procs[kind].append(p)
        return p

    def replica(self, node: int, model: str, env: dict) -> object:
        """A fake engine on node `node`'s loopback and a proxy on the node's address."""
        engine = self.spawn(
            "engine",
            f"{model}-engine",
            node,
            [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py"), "--tokens", "16"],
            {},
        )
        argv = [
            shutil.which("areal-proxy") or "areal-proxy",
            "--host", self.cluster.ip(node),
            "--port", "0",
            "--log-level", "warning",
            "--engine-url", f"http://127.0.0.1:{engine.info['port']}",
            "--engine", "sglang",
            "--model", model,
            "--tokenizer-path", str(PARROT),
            "--proxy-id", f"{model}-data-proxy-0",
            "--db-path", str(self.tmp / f"{model}.sqlite"),
        ]  # fmt: skip
        return self.spawn("proxy", f"{model}-data-proxy-0", node, argv, env)

    def front(self, tag: str, env: dict) -> tuple[object, object, str]:
        """Router (loopback) and gateway (node 1's address) on node 1."""
        router = self.spawn(
            "router",
            f"router-{tag}",
            1,
            [
                shutil.which("areal-router") or "areal-router",
                "--port",
                "0",
                "--log-level",
                "warning",
            ],
            env,
        )
        argv = [
            shutil.which("areal-gateway") or "areal-gateway",
            "--host", self.cluster.ip(1),
            "--port", "0",
            "--router-addr", router.address,
            "--log-level", "warning",
        ]  # fmt: skip
        gateway = self.spawn("gateway", f"gateway-{tag}", 1, argv, env)
        return router, gateway, f"http://{gateway.info['host']}:{gateway.info['port']}"

    def register(self, gateway_url: str, model: str, proxy) -> None:
        import httpx

        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        body = {
            "name": model,
            "kind": "internal",
            "proxies": [{"proxy_id": proxy.comp.name, "address": proxy.address}],
        }
        with httpx.Client(base_url=gateway_url, headers=auth, timeout=30) as c:
            r = c.post("/admin/models", json=body)
            if r.status_code != 201:
                raise RuntimeError(f"register {model}: {r.status_code} {r.text}")
            deadline = time.monotonic() + 60
            while True:
                ws = [w for w in c.get("/admin/workers").json()["workers"] if w["model"] == model]
                health = [str(w.get("health", "")).upper() for w in ws]
                if any(h.endswith("HEALTHY") and "UN" not in h for h in health):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{model}: proxy not healthy: {ws}")
                time.sleep(0.2)

    def run_load(self, spec: dict) -> dict:
        argv = [sys.executable, str(Path(__file__).resolve()), "--load-worker", json.dumps(spec)]
        self.load = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.node(1).ns, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = self.load.communicate(timeout=300)
        finally:
            self._kill_load()
        if self.load.returncode != 0:
            raise RuntimeError(f"load driver failed: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def _kill_load(self) -> None:
        if self.load is not None and self.load.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.load.pid, signal.SIGKILL)
            self.load.wait()

    def part_data(self) -> list[tuple[str, int, dict]]:
        from areal_cli.tls import make_service_pki, write_pki

        token = os.urandom(16).hex()
        base = {"AREAL_INTERNAL_TOKEN": token, "AREAL_ADMIN_API_KEY": ADMIN_KEY}
        tls = {**base, **write_pki(self.tmp / "tls", make_service_pki())}
        router, gateway, url = self.front("tls", tls)
        remote = self.replica(2, "tiny-remote", tls)
        same = self.replica(1, "tiny-same", tls)
        self.register(url, "tiny-remote", remote)
        self.register(url, "tiny-same", same)
        prouter, pgateway, purl = self.front("plain", base)
        plain = self.replica(1, "tiny-plain", base)
        self.register(purl, "tiny-plain", plain)
        setups = {
            "remote": (url, "tiny-remote", gateway, router, remote),
            "same": (url, "tiny-same", gateway, router, same),
            "plain": (purl, "tiny-plain", pgateway, prouter, plain),
        }
        results = []
        for stream in (False, True):
            for conc in CONCURRENCY:
                n = self.args.requests if conc > 1 else self.args.requests // 2
                row = {}
                for key, (gw_url, model, gw, rt, px) in setups.items():
                    body = {
                        "model": model,
                        "prompt": PROMPT_IDS,
                        "max_tokens": 16,
                        "temperature": 0,
                        "stream": stream,
                    }
                    spec = {
                        "url": gw_url + "/v1/completions",
                        "body": json.dumps(body),
                        "stream": stream,
                        "n": n,
                        "conc": conc,
                        "pids": {
                            "gateway": gw.popen.pid,
                            "router": rt.popen.pid,
                            "proxy": px.popen.pid,
                        },
                    }
                    row[key] = self.run_load(spec)
                mode = "stream" if stream else "non-stream"
                results.append((mode, conc, row))
                print(
                    f"  [data {mode} c={conc}] p50 remote {row['remote']['p50']:.2f} / "
                    f"same {row['same']['p50']:.2f} / plain {row['plain']['p50']:.2f} ms",
                    flush=True,
                )
        return results

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        from areal_cli import supervisor

        self._kill_load()
        tiers = [[p.comp for p in self.procs[k]] for k in ("proxy", "gateway", "router", "engine")]
        procs = {p.popen.pid: p.popen for ps in self.procs.values() for p in ps}
        with contextlib.suppress(Exception):
            supervisor.terminate(tiers, grace=3, procs=procs)
        for ps in self.procs.values():
            ps.clear()
        for service, home in list(self.services):  # a run that failed half way
            with contextlib.suppress(Exception):
                self.cli(home, "inf", "stop", "--service", service, "--force", timeout=120)
        self.services.clear()
        try:
            self.cluster.close()  # kills whatever is left in the nodes' pid namespaces
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _print_start(rows: list[tuple[str, dict, dict]]) -> None:
    print(
        "\n1. `areal inf run ... --detach` until it returns healthy, inside node 1 "
        "(sglang:d1, real CPU SGLang engine, tiny-parrot; seconds)\n"
    )
    hdr = (
        f"{'':<7} | {'ray':>6} {'local':>6} {'ray/local':>9} {'ray-local':>9} | "
        f"{'ray: replica ready':>18} {'local: engine healthy':>21} | {'stop ray':>8} {'local':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, ray, local in rows:
        re_, le = ray["engine"], local["engine"]
        print(
            f"{name:<7} | {ray['wall']:>6.1f} {local['wall']:>6.1f} "
            f"{ray['wall'] / local['wall']:>9.2f} {ray['wall'] - local['wall']:>9.1f} | "
            f"{re_ if re_ is not None else float('nan'):>18.1f} "
            f"{le if le is not None else float('nan'):>21.1f} | "
            f"{ray['stop']:>8.1f} {local['stop']:>6.1f}"
        )
    print(
        "(replica ready: placement + unit actor + engine + proxy, as the ray path prints it; "
        "engine healthy: the engine alone, as the local path prints it)"
    )


def _print_data(results: list[tuple[str, int, dict]], requests: int) -> None:
    print(
        "\n2. data path through the gateway, zero-cost fake engine (16 tokens/request; "
        f"{requests} requests at c=32, half at c=1; load from node 1; latencies in ms)\n"
        "   remote: proxy + engine on node 2, TLS; same: on node 1, TLS; plain: on node 1, "
        "no TLS (all with the internal token)\n"
    )
    hdr = (
        f"{'mode':<11}{'c':>3} | {'remote p50':>10} {'p99':>7} {'req/s':>6} | "
        f"{'same p50':>8} {'p99':>7} {'req/s':>6} | {'plain p50':>9} {'p99':>7} {'req/s':>6} | "
        f"{'remote/same p50':>15} {'p99':>5} | {'same/plain p50':>14} {'p99':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    for mode, conc, row in results:
        r, s, p = row["remote"], row["same"], row["plain"]
        print(
            f"{mode:<11}{conc:>3} | {r['p50']:>10.2f} {r['p99']:>7.2f} {r['rps']:>6.0f} | "
            f"{s['p50']:>8.2f} {s['p99']:>7.2f} {s['rps']:>6.0f} | "
            f"{p['p50']:>9.2f} {p['p99']:>7.2f} {p['rps']:>6.0f} | "
            f"{r['p50'] / s['p50']:>15.2f} {r['p99'] / s['p99']:>5.2f} | "
            f"{s['p50'] / p['p50']:>14.2f} {s['p99'] / p['p99']:>5.2f}"
        )
        if mode == "stream":
            print(
                f"{'':<14} | ttft p50 {r.get('ttft_p50', 0):>6.2f}{'':>8} | "
                f"ttft {s.get('ttft_p50', 0):>6.2f}{'':>10} | ttft {p.get('ttft_p50', 0):>6.2f}"
            )
        errs = {k: v["errors"] for k, v in row.items() if v["errors"]}
        if errs:
            print(f"{'':<14} | errors: {errs}")
    print("\nCPU ms per request (from /proc/<pid>/stat over each measured run)\n")
    hdr = (
        f"{'mode':<11}{'c':>3} | {'remote: gateway':>15} {'router':>6} {'proxy':>6} {'sum':>6} | "
        f"{'same: gateway':>13} {'router':>6} {'proxy':>6} {'sum':>6} | "
        f"{'plain: gateway':>14} {'router':>6} {'proxy':>6} {'sum':>6} | "
        f"{'remote/same':>11} {'same/plain':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for mode, conc, row in results:
        cells, sums = [], {}
        for key, w in (("remote", 15), ("same", 13), ("plain", 14)):
            c = row[key]["cpu_ms"]
            sums[key] = c["gateway"] + c["router"] + c["proxy"]
            cells.append(
                f"{c['gateway']:>{w}.3f} {c['router']:>6.3f} {c['proxy']:>6.3f} {sums[key]:>6.3f}"
            )
        ratio = (
            f"{sums['remote'] / sums['same']:>11.2f} {sums['same'] / sums['plain']:>10.2f}"
            if sums["same"] and sums["plain"]
            else ""
        )
        print(f"{mode:<11}{conc:>3} | " + " | ".join(cells) + " | " + ratio)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="ray/local start pairs (default 1)")
    ap.add_argument("--requests", type=int, default=2000, help="per c=32 row (c=1: half)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--no-start", action="store_true", help="leave out part 1")
    ap.add_argument("--no-data", action="store_true", help="leave out part 2")
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_worker:
        return load_worker(args.load_worker)
    cmd = "uv run --no-sync python benchmarks/ray_scheduler.py"
    extra = []
    if args.repeat != 1:
        extra.append(f"--repeat {args.repeat}")
    if args.requests != 2000:
        extra.append(f"--requests {args.requests}")
    extra += [f for f, on in (("--no-start", args.no_start), ("--no-data", args.no_data)) if on]
    print(f"reproduce (as root, repo root): {' '.join([cmd, *extra])}")
    print(f"({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(args)
    t0 = time.monotonic()
    try:
        bench.cluster.start()
        print(f"  two-node netns Ray cluster up in {bench.cluster.timings['start_s']:.1f}s")
        start_rows = [] if args.no_start else bench.part_start()
        data_rows = [] if args.no_data else bench.part_data()
    finally:
        bench.close()
    if start_rows:
        _print_start(start_rows)
    if data_rows:
        _print_data(data_rows, args.requests)
    print(f"\n(whole run {time.monotonic() - t0:.0f}s, load average now {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
