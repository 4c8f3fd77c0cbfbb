"""The streamed path's token rate: can areal carry what a GPU engine emits?

    uv run python benchmarks/token_rate.py [--streams 16,64,128,256] [--tokens 128,1024]
        [--rounds 2] [--answers 2] [--interval-ms 20] [--stream-interval 1]
        [--only direct,smg,admin,recorded] [--json PATH]

The *zero-cost fake engine* (benchmarks/fake_engine.py) stands in for a GPU: it paces one
event per stream every `--interval-ms` (each carrying `--stream-interval` tokens, as SGLang's
`--stream-interval`), so S streams offer S * 1000 / interval tokens per second whatever serves
them. Each stream asks for `--answers` streamed chat answers of T tokens back to back, through

* `direct`: the engine's own `/v1/chat/completions`;
* `SMG`: smg 1.13 (benchmarks/vs_smg.py installs it into its own cached venv);
* `areal, admin key` and `areal, recorded` (a session key: every answer recorded): the real
  gateway, router and one data proxy (tests/e2e/stack.py).

Rounds interleaved (round -> config -> who). Printed per run and as medians over rounds:
delivered tokens/s (the answers' `usage.completion_tokens` over the wall time) and its ratio
to direct, CPU microseconds per delivered token of each layer's own processes (psutil), the
busiest process's share of one core, p50/p99 of the answer's time and of the gap between
content events a client sees (an event may carry several tokens once coalesced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stack import ADMIN_KEY, launch  # noqa: E402
from vs_smg import (  # noqa: E402
    MODEL,
    SMG_VERSION,
    end_session,
    ensure_smg,
    start_quiet_stack,
    start_session,
    start_smg,
)

from areal_cli import supervisor  # noqa: E402

WHO = {
    "direct": "direct",
    "smg": "SMG",
    "admin": "areal, admin key",
    "recorded": "areal, recorded",
}
_USAGE = b'"completion_tokens":'


def chat_body(tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say something long."},
            ],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def cpu_times(procs: dict[str, list[psutil.Process]]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for name, ps in procs.items():
        out[name] = {}
        for p in ps:
            try:
                t = p.cpu_times()
                out[name][p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                out[name][p.pid] = 0.0
    return out


def quantiles(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=100)
    return q[49], q[98]


async def run_streams(
    url: str,
    headers: dict[str, str],
    body: bytes,
    warm_body: bytes,
    streams: int,
    answers: int,
    procs: dict[str, list[psutil.Process]],
) -> dict:
    """`streams` clients, each asking `answers` streamed answers back to back."""
    answer_s: list[float] = []
    gaps: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}

    async def one(http: aiohttp.ClientSession, body: bytes = body) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        last_content = None
        tail = b""
        try:
            async with http.post(url, data=body) as r:
                if r.status != 200:
                    k = f"{r.status} {(await r.read())[:120]!r}"
                    errors[k] = errors.get(k, 0) + 1
                    return
                async for data in r.content.iter_any():
                    now = time.perf_counter()
                    if b'"content"' in data:
                        if last_content is not None:
                            gaps.append(now - last_content)
                        last_content = now
                    tail = (tail + data)[-2048:]
        except aiohttp.ClientError as e:
            k = repr(e)[:120]
            errors[k] = errors.get(k, 0) + 1
            return
        at = tail.rfind(_USAGE)
        if not tail.rstrip().endswith(b"data: [DONE]") or at < 0:
            errors["stream without usage or [DONE]"] = errors.get("stream without usage", 0) + 1
            return
        rest = tail[at + len(_USAGE) :]
        tokens += int(rest[: len(rest) - len(rest.lstrip(b" 0123456789"))])
        answer_s.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, headers=headers, timeout=timeout) as http:
        # Warm-up: connections open, short answers.
        await asyncio.gather(*(one(http, warm_body) for _ in range(min(streams, 8))))
        answer_s.clear()
        gaps.clear()
        tokens = 0
        errors.clear()

        async def client() -> None:
            for _ in range(answers):
                await one(http)

        before = cpu_times(procs)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        wall = time.perf_counter() - t0
        after = cpu_times(procs)
    if not tokens:
        raise RuntimeError(f"no answer through {url}: {errors}")
    cpu_us = {
        name: sum(after[name][pid] - before[name][pid] for pid in after[name]) / tokens * 1e6
        for name in procs
    }
    busiest = (
        max(
            (after[n][pid] - before[n][pid]) / wall
            for n in procs
            if n != "engine"
            for pid in after[n]
        )
        if any(n != "engine" for n in procs)
        else 0.0
    )
    a50, a99 = quantiles(answer_s)
    g50, g99 = quantiles(gaps)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "cpu_us": cpu_us,
        "busiest_core": busiest,
        "answer_p50_s": a50,
        "answer_p99_s": a99,
        "gap_p50_ms": g50 * 1e3,
        "gap_p99_ms": g99 * 1e3,
    }


def start_py_spy(
    out_dir: str, procs: dict[str, list[psutil.Process]], tag: str
) -> list[subprocess.Popen]:
    """py-spy sampling the gateway and the proxy (collapsed stacks, `--profile DIR`)."""
    spy = shutil.which("py-spy") or str(Path.home() / ".local" / "bin" / "py-spy")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                "200",
                "-p",
                str(procs[name][0].pid),
                "-o",
                f"{out_dir}/{name}-{tag}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("gateway", "proxy")
    ]


def stop_py_spy(spies: list[subprocess.Popen]) -> None:
    for p in spies:
        p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in spies:
        p.wait(timeout=30)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def layer_us(r: dict) -> float:
    return sum(v for k, v in r["cpu_us"].items() if k not in ("engine", "router"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="16,64,128,256")
    ap.add_argument("--tokens", default="128,1024", help="tokens per answer")
    ap.add_argument("--answers", type=int, default=2, help="answers per stream, back to back")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per engine event")
    ap.add_argument("--only", default="", help=f"subset of {','.join(WHO)}")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="py-spy the gateway and proxy into DIR")
    args = ap.parse_args()
    whos = [w for w in args.only.split(",") if w] if args.only else list(WHO)
    for w in whos:
        if w not in WHO:
            ap.error(f"--only: unknown {w!r}")
    sizes = [int(x) for x in args.streams.split(",")]
    lengths = [int(x) for x in args.tokens.split(",")]
    load_start = os.getloadavg()
    smg_binary = ensure_smg() if "smg" in whos else None
    tmp = Path(tempfile.mkdtemp(prefix="areal-token-rate-"))
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "fake_engine.py"),
        "--tokens",
        str(max(lengths)),
        "--model-id",
        MODEL,
        "--token-interval-ms",
        str(args.interval_ms),
        "--stream-interval",
        str(args.stream_interval),
    ]
    engine = launch("fake-engine", argv, tmp, {})
    engine_url = f"http://127.0.0.1:{engine.info['port']}"
    stack = smg = None
    raw: dict[str, dict[str, list[dict]]] = {}
    try:
        if {"admin", "recorded"} & set(whos):
            stack = start_quiet_stack(tmp, engine_url)
        if smg_binary is not None:
            smg = start_smg(smg_binary, engine_url, tmp)
        engine_procs = {"engine": [psutil.Process(engine.popen.pid)]}
        targets: dict[str, tuple[str, dict[str, list[psutil.Process]]]] = {}
        if "direct" in whos:
            targets["direct"] = (engine_url, {})
        if smg is not None:
            root = psutil.Process(smg[0].pid)
            targets["smg"] = (smg[2], {"smg": [root, *root.children(recursive=True)]})
        if stack is not None:
            procs = {
                "gateway": [psutil.Process(stack.gateway.popen.pid)],
                "router": [psutil.Process(stack.router.popen.pid)],
                "proxy": [psutil.Process(stack.proxies[0].popen.pid)],
            }
            for w in ("admin", "recorded"):
                if w in whos:
                    targets[w] = (stack.gateway_url, procs)
        for rnd in range(1, args.rounds + 1):
            for length in lengths:
                for n in sizes:
                    cfg = f"{n} streams x {length} tok"
                    raw.setdefault(cfg, {w: [] for w in whos})
                    for who in whos:
                        base, procs_ = targets[who]
                        headers = {"Content-Type": "application/json"}
                        key = None
                        if who == "admin":
                            headers["Authorization"] = f"Bearer {ADMIN_KEY}"
                        elif who == "recorded":
                            assert stack is not None
                            key = start_session(stack.gateway_url, f"rate-{rnd}-{n}-{length}")
                            headers["Authorization"] = f"Bearer {key}"
                        spies = (
                            start_py_spy(args.profile, procs_, f"{who}-{n}-{length}-r{rnd}")
                            if args.profile and who in ("admin", "recorded")
                            else []
                        )
                        r = asyncio.run(
                            run_streams(
                                base + "/v1/chat/completions",
                                headers,
                                chat_body(length),
                                chat_body(min(length, 16)),
                                n,
                                args.answers,
                                {**procs_, **engine_procs},
                            )
                        )
                        stop_py_spy(spies)
                        if key is not None:
                            assert stack is not None
                            end_session(stack.gateway_url, key)
                        raw[cfg][who].append(r)
                        per = " ".join(
                            f"{k} {v:.0f}" for k, v in r["cpu_us"].items() if k != "engine"
                        )
                        print(
                            f"round {rnd} {cfg:<22} {WHO[who]:<17} {r['tok_s']:>7.0f} tok/s "
                            f"answer p50 {r['answer_p50_s']:.2f} s gap p50/p99 "
                            f"{r['gap_p50_ms']:.1f}/{r['gap_p99_ms']:.1f} ms "
                            f"CPU us/token {per or '-'} busiest {r['busiest_core']:.0%}"
                            + (f" errors {r['error_kinds']}" if r["errors"] else ""),
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        if smg is not None:
            supervisor.terminate([[smg[1]]], grace=15, procs={smg[0].pid: smg[0]})
        if stack is not None:
            stack.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    load_end = os.getloadavg()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"\ntoken rate, zero-cost fake engine paced at {args.interval_ms:g} ms per event "
        f"({args.stream_interval} token(s) per event), {args.answers} answers per stream, "
        f"medians of {args.rounds} interleaved rounds; commit {commit or '?'}; "
        f"{os.cpu_count()} cpus, load average {load_start[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end; SMG {SMG_VERSION}; CPU: us per delivered token of the "
        "layer's own processes (areal: gateway+proxy, router shown apart)\n"
    )
    print(
        "| config | who | tok/s | vs direct | CPU us/token | busiest core "
        "| answer p50 / p99 s | p50 vs direct | gap p50 / p99 ms |"
    )
    print("| --- | --- | ---: | ---: | --- | ---: | --- | ---: | --- |")
    for cfg, by_who in raw.items():
        d_rate = med([r["tok_s"] for r in by_who.get("direct", [])])
        d_p50 = med([r["answer_p50_s"] for r in by_who.get("direct", [])])
        for who, runs in by_who.items():
            rate = med([r["tok_s"] for r in runs])
            p50 = med([r["answer_p50_s"] for r in runs])
            if who == "direct":
                cpu = "-"
            elif who == "smg":
                cpu = f"{med([r['cpu_us']['smg'] for r in runs]):.0f}"
            else:
                g = med([r["cpu_us"]["gateway"] for r in runs])
                p = med([r["cpu_us"]["proxy"] for r in runs])
                rt = med([r["cpu_us"]["router"] for r in runs])
                cpu = (
                    f"{med([layer_us(r) for r in runs]):.0f} (gw {g:.0f} / px {p:.0f}; rt {rt:.0f})"
                )
            err = sum(r["errors"] for r in runs)
            print(
                f"| {cfg} | {WHO[who]}{f' ({err} errors)' if err else ''} | {rate:,.0f} "
                f"| {rate / d_rate:.2f} | {cpu} | {med([r['busiest_core'] for r in runs]):.0%} "
                f"| {p50:.2f} / {med([r['answer_p99_s'] for r in runs]):.2f} "
                f"| {p50 / d_p50:.2f} "
                f"| {med([r['gap_p50_ms'] for r in runs]):.1f} / "
                f"{med([r['gap_p99_ms'] for r in runs]):.1f} |"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "commit": commit,
                    "args": vars(args),
                    "loadavg": [load_start, load_end],
                    "raw": raw,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
