"""areal's inference data path next to SMG (Shepherd Model Gateway, a Rust router for SGLang).

    uv run python benchmarks/vs_smg.py [--rounds 3] [--requests-c1 500] [--requests-c64 3000]
        [--tokens 16] [--json PATH] [--only direct,smg,admin,recorded]

One *zero-cost fake engine* (benchmarks/fake_engine.py) answers both: SMG routes OpenAI's
`POST /v1/chat/completions` to it as it does to a SGLang worker over HTTP (it passes the
request on; the engine applies the chat template and tokenizes), and areal's stack (router,
gateway, one data proxy, started like the CLI does through tests/e2e/stack.py) sends it
token ids on `/generate` after the proxy has applied the chat template and tokenized, and
detokenizes the answer (what lets areal record token-exact RL data). The same chat body goes
to four places:

* `direct`: the fake engine's own `/v1/chat/completions`;
* `SMG`: `smg launch --policy round_robin` (smg==1.13.0, installed into its own venv in
  `$XDG_CACHE_HOME/areal/bench/`, never the workspace) in front of that engine;
* `areal, admin key`: the gateway's `/v1/chat/completions` with the admin key (not recorded);
* `areal, recorded`: the same with an RL session key (`POST /rl/start_session`): every
  request becomes one recorded interaction; a fresh session for each run (round x config).

At c=1 and c=64, non-stream and stream, rounds interleaved (round -> config -> who, each
run after a warm-up of 50 requests). Prints the medians over rounds of req/s, p50, p99, the
p50 added over `direct` in the same round, and the CPU per request of the layer's own
processes (SMG: its process tree; areal: gateway + router + proxy, each shown), from
/proc/<pid>/stat over the measured requests only; then areal against SMG. Client, layers and
engine share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

SMG_VERSION = "1.13.0"
MODEL = "tiny-parrot"
WHO = {
    "direct": "direct",
    "smg": "SMG",
    "admin": "areal, admin key",
    "recorded": "areal, recorded",
}
AREAL_PROCS = ("gateway", "router", "proxy")


# --- SMG: install into its own venv, start, stop ---------------------------------------


def smg_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "areal" / "bench" / f"smg-{SMG_VERSION}"


def ensure_smg() -> Path:
    """The `smg` console script of smg==SMG_VERSION in its own venv (installed once)."""
    venv = smg_venv()
    binary = venv / "bin" / "smg"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    uv = shutil.which("uv")
    print(f"installing smg=={SMG_VERSION} into {venv} ...", file=sys.stderr, flush=True)
    # Not the workspace's environment: `uv run` exports it, and uv would install there.
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    if uv:
        if not python.exists():
            subprocess.run([uv, "venv", "-q", "--allow-existing", str(venv)], check=True, env=env)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(python), f"smg=={SMG_VERSION}"],
            check=True,
            env=env,
        )
    else:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"smg=={SMG_VERSION}"], check=True, env=env
        )
    if not binary.is_file():
        raise RuntimeError(f"smg=={SMG_VERSION} installed, but {binary} is missing")
    return binary


def start_smg(binary: Path, engine_url: str, log_dir: Path, timeout: float = 60):
    """`smg launch` in its own process group; returns (popen, component, url) once a chat
    request through it answers 200 (its worker discovered, healthy and routed to)."""
    port = supervisor.free_port()
    argv = [
        str(binary),
        "launch",
        "--worker-urls",
        engine_url,
        "--policy",
        "round_robin",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Its metrics listener defaults to 0.0.0.0:29000: a free local port instead.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(supervisor.free_port()),
        # At info it logs every request (two lines each).
        "--log-level",
        "warn",
    ]
    popen, comp = supervisor.spawn("smg", argv, log_dir / "smg.log", host="127.0.0.1", port=port)
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    last = ""
    try:
        while True:
            if popen.poll() is not None:
                raise RuntimeError(
                    f"smg exited ({popen.returncode}):\n{supervisor.log_tail(log_dir / 'smg.log')}"
                )
            try:
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
                if r.status_code == 200:
                    return popen, comp, url
                last = f"HTTP {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"smg does not route after {timeout}s ({last}):\n"
                    f"{supervisor.log_tail(log_dir / 'smg.log')}"
                )
            time.sleep(0.1)
    except BaseException:
        # SMG keeps its listener open 5 s after SIGTERM (a load balancer's settle window).
        supervisor.terminate([[comp]], grace=15, procs={popen.pid: popen})
        raise


# --- CPU from /proc ---------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """Seconds of CPU (user + system, all threads) the process has used; 0 once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def process_tree(root: int) -> list[int]:
    """The process and its descendants (from each /proc/<pid>/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}


# --- load -------------------------------------------------------------------------------


async def run_load(
    url: str,
    body: bytes,
    headers: dict,
    n: int,
    conc: int,
    stream: bool,
    pids: dict[str, list[int]],
    warmup: int = 50,
) -> dict:
    """n requests at concurrency conc after a warm-up; latency, req/s and the CPU of `pids`
    over the measured requests only. A stream counts as an error unless it ends in [DONE]."""
    lat: list[float] = []
    ttft: list[float] = []
    kinds: dict[str, int] = {}
    sem = asyncio.Semaphore(conc)
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn, headers=headers) as http:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    async with http.post(url, data=body) as r:
                        if r.status != 200:
                            text = (await r.read())[:200].decode(errors="replace")
                            kind = f"{r.status} {text}"
                            kinds[kind] = kinds.get(kind, 0) + 1
                            return
                        if not stream:
                            await r.read()
                        else:
                            first, last = None, b""
                            async for line in r.content:
                                if not line.startswith(b"data:"):
                                    continue
                                if first is None:
                                    first = time.perf_counter()
                                    ttft.append(first - t0)
                                last = line
                            if last.strip() != b"data: [DONE]":
                                kinds["stream without [DONE]"] = (
                                    kinds.get("stream without [DONE]", 0) + 1
                                )
                                return
                except aiohttp.ClientError as e:
                    kinds[repr(e)[:200]] = kinds.get(repr(e)[:200], 0) + 1
                    return
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(min(warmup, n))))
        lat.clear()
        ttft.clear()
        kinds.clear()
        before = cpu_snapshot(pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        after = cpu_snapshot(pids)
    if not lat:
        raise RuntimeError(f"every request to {url} failed: {kinds}")
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    out = {
        "n": n,
        "ok": len(lat),
        "errors": sum(kinds.values()),
        "error_kinds": kinds,
        "wall_s": wall,
        "rps": len(lat) / wall,
        "p50": q[49] * 1e3,
        "p99": q[98] * 1e3,
        "cpu_ms": {k: (after[k] - before[k]) / n * 1e3 for k in pids},
    }
    if stream and ttft:
        out["ttft_p50"] = statistics.median(ttft) * 1e3
    return out


def start_fake_engine(tmp: Path, tokens: int):
    """The zero-cost fake engine answering `tokens` tokens for the model MODEL, and its URL."""
    engine = launch(
        "fake-engine",
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fake_engine.py"),
            "--tokens",
            str(tokens),
            "--model-id",
            MODEL,
        ],
        tmp,
        {},
    )
    return engine, f"http://127.0.0.1:{engine.info['port']}"


def start_quiet_stack(tmp: Path, engine_url: str):
    """areal's router, gateway and one proxy in front of `engine_url`, logging warnings only."""
    quiet = ["--log-level", "warning"]
    return start_stack(
        tmp,
        engine_url,
        ROOT / "models" / MODEL,
        n_proxies=1,
        gateway_args=quiet,
        proxy_args=quiet,
        router_args=quiet,
    )


def chat_body(stream: bool, tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say something short."},
            ],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": stream,
        }
    )


def start_session(gateway_url: str, task: str) -> str:
    r = httpx.post(
        gateway_url + "/rl/start_session",
        json={"task_id": task, "group_size": 1},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    if r.status_code != 201:
        raise RuntimeError(f"start_session: HTTP {r.status_code} {r.text[:300]}")
    return r.json()["sessions"][0]["session_api_key"]


def end_session(gateway_url: str, key: str) -> None:
    r = httpx.post(
        gateway_url + "/rl/end_session",
        json={},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    if r.status_code != 200:
        print(f"  end_session: HTTP {r.status_code} {r.text[:200]}", file=sys.stderr)


# --- report -----------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict], who: str) -> dict:
    """Medians over rounds of one (config, who)'s runs."""
    s: dict = {
        "rps": med([r["rps"] for r in runs]),
        "p50": med([r["p50"] for r in runs]),
        "p99": med([r["p99"] for r in runs]),
        "errors": sum(r["errors"] for r in runs),
        "rounds": len(runs),
    }
    if all("added_p50" in r for r in runs):
        s["added_p50"] = med([r["added_p50"] for r in runs])
    names = [k for k in runs[0]["cpu_ms"] if k != "engine"]
    s["cpu_ms"] = {k: med([r["cpu_ms"][k] for r in runs]) for k in names}
    s["cpu_ms_layer"] = med([sum(r["cpu_ms"][k] for k in names) for r in runs])
    s["cpu_ms_engine"] = med([r["cpu_ms"]["engine"] for r in runs])
    if all("ttft_p50" in r for r in runs):
        s["ttft_p50"] = med([r["ttft_p50"] for r in runs])
    return s


def fmt_cpu(who: str, s: dict) -> str:
    if who == "direct":
        return "-"
    if who == "smg":
        return f"{s['cpu_ms_layer']:.3f}"
    parts = "/".join(f"{s['cpu_ms'][k]:.3f}" for k in AREAL_PROCS)
    return f"{s['cpu_ms_layer']:.3f} ({parts})"


def report(summary: dict, configs: list[str], whos: list[str]) -> list[str]:
    lines = [
        "| config | who | req/s | p50 ms | p99 ms | added p50 ms "
        "| CPU ms/req (gateway/router/proxy) | engine CPU ms/req |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for cfg in configs:
        for who in whos:
            s = summary[cfg][who]
            added = f"{s['added_p50']:.2f}" if "added_p50" in s and who != "direct" else "-"
            err = f" ({s['errors']} errors)" if s["errors"] else ""
            lines.append(
                f"| {cfg} | {WHO[who]}{err} | {s['rps']:,.0f} | {s['p50']:.2f} | {s['p99']:.2f} "
                f"| {added} | {fmt_cpu(who, s)} | {s['cpu_ms_engine']:.3f} |"
            )
    if "smg" in whos and ({"admin", "recorded"} & set(whos)):
        lines += [
            "",
            "| config | areal | CPU areal / SMG | added p50 areal - SMG (ms) | req/s areal / SMG |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for cfg in configs:
            smg = summary[cfg]["smg"]
            for who in ("admin", "recorded"):
                if who not in whos:
                    continue
                a = summary[cfg][who]
                ratio = a["cpu_ms_layer"] / smg["cpu_ms_layer"] if smg["cpu_ms_layer"] else 0
                gap = (
                    f"{a['added_p50'] - smg['added_p50']:+.2f}"
                    if "added_p50" in a and "added_p50" in smg
                    else "-"
                )
                lines.append(
                    f"| {cfg} | {WHO[who]} | {ratio:.1f}x | {gap} | {a['rps'] / smg['rps']:.2f} |"
                )
    return lines


# --- main -------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-c1", type=int, default=500)
    ap.add_argument("--requests-c64", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--json", default="", help="write every run's numbers and the medians here")
    ap.add_argument(
        "--only",
        default="",
        help=f"comma-separated subset of {','.join(WHO)} (added p50 needs direct)",
    )
    args = ap.parse_args()
    whos = [w.strip() for w in args.only.split(",") if w.strip()] if args.only else list(WHO)
    for w in whos:
        if w not in WHO:
            ap.error(f"--only: unknown {w!r} (one of {', '.join(WHO)})")
    configs = [
        (f"c={c} {'stream' if stream else 'non-stream'}", c, stream)
        for c in (1, 64)
        for stream in (False, True)
    ]
    load_start = os.getloadavg()
    print(
        f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
        f"({os.cpu_count()} cpus)",
        file=sys.stderr,
    )
    smg_binary = ensure_smg() if "smg" in whos else None
    tmp = Path(tempfile.mkdtemp(prefix="areal-vs-smg-"))
    engine, engine_url = start_fake_engine(tmp, args.tokens)
    stack = smg = None
    try:
        if {"admin", "recorded"} & set(whos):
            stack = start_quiet_stack(tmp, engine_url)
        if smg_binary is not None:
            smg = start_smg(smg_binary, engine_url, tmp)
        engine_pids = {"engine": [engine.popen.pid]}
        plain = {"Content-Type": "application/json"}
        targets: dict[str, tuple[str, dict[str, list[int]]]] = {}
        if "direct" in whos:
            targets["direct"] = (engine_url, {})
        if smg is not None:
            smg_pids = process_tree(smg[0].pid)
            targets["smg"] = (smg[2], {"smg": smg_pids})
        if stack is not None:
            areal_pids = {
                "gateway": [stack.gateway.popen.pid],
                "router": [stack.router.popen.pid],
                "proxy": [stack.proxies[0].popen.pid],
            }
            for w in ("admin", "recorded"):
                if w in whos:
                    targets[w] = (stack.gateway_url, areal_pids)
        raw: dict[str, dict[str, list[dict]]] = {c[0]: {w: [] for w in whos} for c in configs}
        for rnd in range(1, args.rounds + 1):
            for cfg, conc, stream in configs:
                n = args.requests_c1 if conc == 1 else args.requests_c64
                body = chat_body(stream, args.tokens)
                direct_p50 = None
                for who in whos:
                    base, pids = targets[who]
                    headers = dict(plain)
                    key = None
                    if who == "admin":
                        headers["Authorization"] = f"Bearer {ADMIN_KEY}"
                    elif who == "recorded":
                        assert stack is not None
                        key = start_session(stack.gateway_url, f"vs-smg-{rnd}-{conc}-{stream}")
                        headers["Authorization"] = f"Bearer {key}"
                    r = asyncio.run(
                        run_load(
                            base + "/v1/chat/completions",
                            body,
                            headers,
                            n,
                            conc,
                            stream,
                            {**pids, **engine_pids},
                        )
                    )
                    if key is not None:
                        assert stack is not None
                        end_session(stack.gateway_url, key)
                    if who == "direct":
                        direct_p50 = r["p50"]
                    elif direct_p50 is not None:
                        r["added_p50"] = r["p50"] - direct_p50
                    r["round"] = rnd
                    raw[cfg][who].append(r)
                    layer = sum(v for k, v in r["cpu_ms"].items() if k != "engine")
                    print(
                        f"round {rnd} {cfg:<15} {WHO[who]:<17} {r['rps']:>7.0f} req/s "
                        f"p50 {r['p50']:7.2f} p99 {r['p99']:7.2f} ms CPU {layer:.3f} ms/req"
                        + (f" errors {r['errors']} {r['error_kinds']}" if r["errors"] else ""),
                        file=sys.stderr,
                        flush=True,
                    )
        summary = {c[0]: {w: summarize(raw[c[0]][w], w) for w in whos} for c in configs}
    finally:
        if smg is not None:
            # SMG keeps its listener open 5 s after SIGTERM (a load balancer's settle window).
            supervisor.terminate([[smg[1]]], grace=15, procs={smg[0].pid: smg[0]})
        if stack is not None:
            stack.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    shutil.rmtree(tmp, ignore_errors=True)  # kept (with the logs) when a run fails
    load_end = os.getloadavg()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(
        f"\nareal vs SMG {SMG_VERSION}, zero-cost fake engine, chat with {args.tokens} output "
        f"tokens; {args.requests_c1} requests at c=1, {args.requests_c64} at c=64; medians of "
        f"{args.rounds} interleaved rounds; commit {commit or '?'}; {os.cpu_count()} cpus, load "
        f"average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; CPU: the layer's own "
        f"processes per request (areal: total (gateway/router/proxy))\n"
    )
    print("\n".join(report(summary, [c[0] for c in configs], whos)))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "smg_version": SMG_VERSION,
                    "commit": commit,
                    "cpus": os.cpu_count(),
                    "loadavg_start": load_start,
                    "loadavg_end": load_end,
                    "args": vars(args),
                    "raw": raw,
                    "summary": summary,
                },
                indent=1,
            )
        )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
