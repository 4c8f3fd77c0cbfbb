"""CPU per streamed token of the data proxy, from short to long answers, on the real engine.

    uv run python benchmarks/stream_cost.py [--sizes 16,256,1024,4096] [--modes cumulative,incremental]

Starts a CPU SGLang engine serving the tiny parrot model (greedy decoding repeats the last
prompt token, so every request runs to its `max_tokens`), with a context of 8,192 tokens
(`--json-model-override-args` raises `max_position_embeddings`; the parrot ignores positions),
and a stack in front of it (router, gateway, one data proxy; tests/e2e/stack.py). For each
answer length it streams completions through the gateway and reads the CPU time of the proxy
and gateway processes from /proc/<pid>/stat over the run.

It does this twice in one run, one engine at a time: first with the engine started without
`--incremental-streaming-output` (SGLang's default, where every stream event carries all ids
and logprobs so far), then with it (what areal starts). Prints, side by side, the proxy's CPU
per streamed token, the CPU each extra token costs between two lengths (flat when the cost is
linear, growing when it is quadratic), the gateway's CPU per token, and the bytes the engine
sent per token. The proxy's CPU with no traffic (measured for 20 s before each mode's runs)
is subtracted over each run's wall time: on a loaded machine the engine may decode a few
tokens per second, and the idle CPU of minutes would otherwise swamp the streams' own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, start_stack  # noqa: E402

from areal_cli import engines, supervisor  # noqa: E402

PARROT = ROOT / "models" / "tiny-parrot"
MODEL = "tiny-parrot"
CONTEXT = 8192
TICK = os.sysconf("SC_CLK_TCK")
PROMPT = [5, 6, 7, 8]
# Requests and concurrency per answer length: enough tokens that the 10 ms CPU tick is small
# against each run; long answers run 8 at once, because a decode step of the tiny model costs
# about the same for 1 or 8 sequences, so the streams' CPU grows against the proxy's idle CPU.
PLAN = {16: (64, 8), 64: (32, 8), 256: (8, 8), 1024: (8, 8), 2048: (8, 8), 4096: (8, 8)}
FLAG = "--incremental-streaming-output"
# Seconds of no traffic over which the proxy's idle CPU rate is measured.
IDLE_S = 20.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start_engine(
    log_dir: Path, incremental: bool, more_args: list[str] | None = None
) -> tuple[str, supervisor.Component, object]:
    port = supervisor.free_port()
    launch = engines.engine_launch(
        "sglang",
        python=engines.resolve_python("sglang"),
        model_path=str(PARROT),
        served_name=MODEL,
        host="127.0.0.1",
        port=port,
        extra_args=[
            *engines.SGLANG_CPU_ARGS.split(),
            # A fraction of the memory that is free: 0.05 failed to leave room for the KV
            # cache while other engines held most of a 24 GiB machine.
            "--mem-fraction-static",
            "0.1",
            "--max-total-tokens",
            str(4 * (CONTEXT + 64)),
            "--context-length",
            str(CONTEXT),
            "--json-model-override-args",
            json.dumps({"max_position_embeddings": CONTEXT}),
            *(more_args or []),
        ],
    )
    argv = launch.argv if incremental else [a for a in launch.argv if a != FLAG]
    name = f"stream-cost-engine-{'inc' if incremental else 'cum'}"
    proc, comp = supervisor.spawn(name, argv, log_dir / f"{name}.log", env=launch.env)
    url = f"http://127.0.0.1:{port}"
    try:
        supervisor.wait_ready(proc, comp, lambda: supervisor.http_ok(url + "/health"), 600)
    except BaseException:
        supervisor.terminate([[comp]], grace=5, procs={proc.pid: proc})
        raise
    return url, comp, proc


async def engine_bytes_per_token(url: str, tokens: int) -> float:
    """Bytes of SSE body the engine sends per token for one stream of `tokens` tokens."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    timeout = aiohttp.ClientTimeout(total=None)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url + "/generate", json=body) as r,
    ):
        n = 0
        async for data in r.content.iter_any():
            n += len(data)
    return n / tokens


@dataclass
class Run:
    tokens: int
    requests: int
    wall_s: float
    proxy_cpu_s: float
    gateway_cpu_s: float
    engine_bytes_per_token: float
    # The proxy's CPU per second with no traffic (gRPC poller, the router's GetStats polls,
    # engine health checks), subtracted over the run's wall time: on a loaded machine the
    # engine decodes a few tokens per second and this would otherwise dominate long runs.
    proxy_idle_cpu_per_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.tokens * self.requests

    @property
    def proxy_stream_cpu_s(self) -> float:
        return max(self.proxy_cpu_s - self.proxy_idle_cpu_per_s * self.wall_s, 0.0)

    def proxy_us_per_token(self) -> float:
        return self.proxy_stream_cpu_s / self.total_tokens * 1e6

    def proxy_raw_us_per_token(self) -> float:
        return self.proxy_cpu_s / self.total_tokens * 1e6

    def proxy_ms_per_request(self) -> float:
        return self.proxy_stream_cpu_s / self.requests * 1e3

    def gateway_us_per_token(self) -> float:
        return self.gateway_cpu_s / self.total_tokens * 1e6


async def one_stream(s: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = 0
    async with s.post(url + "/v1/completions", data=orjson.dumps(body)) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                got = int(chunk["usage"]["completion_tokens"])
    if got != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {got}")
    return got


async def run_size(
    gateway_url: str, engine_url: str, proxy_pid: int, gateway_pid: int, tokens: int
) -> Run:
    requests, conc = PLAN.get(tokens, (4, 4))
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as s:
        await one_stream(s, gateway_url, 4)  # warm: channel, stream, tokenizer caches
        sem = asyncio.Semaphore(conc)

        async def bounded() -> int:
            async with sem:
                return await one_stream(s, gateway_url, tokens)

        # One stream straight from the engine rides along (one more sequence in the batch,
        # no proxy or gateway work) to count what the engine sends per token.
        direct = asyncio.ensure_future(engine_bytes_per_token(engine_url, tokens))
        p0, g0, t0 = cpu_seconds(proxy_pid), cpu_seconds(gateway_pid), time.monotonic()
        await asyncio.gather(*(bounded() for _ in range(requests)))
        wall = time.monotonic() - t0
        p1, g1 = cpu_seconds(proxy_pid), cpu_seconds(gateway_pid)
        per_token = await direct
    return Run(tokens, requests, wall, p1 - p0, g1 - g0, per_token)


async def run_mode(log_dir: Path, incremental: bool, sizes: list[int]) -> list[Run]:
    mode = "incremental" if incremental else "cumulative"
    engine_url, comp, proc = start_engine(log_dir, incremental)
    stack = None
    try:
        stack = start_stack(
            log_dir / mode,
            engine_url,
            PARROT,
            n_proxies=1,
            proxy_args=["--context-length", str(CONTEXT), "--log-level", "warning"],
            gateway_args=["--log-level", "warning"],
        )
        proxy_pid, gateway_pid = stack.proxies[0].popen.pid, stack.gateway.popen.pid
        p0, t0 = cpu_seconds(proxy_pid), time.monotonic()
        await asyncio.sleep(IDLE_S)
        idle = (cpu_seconds(proxy_pid) - p0) / (time.monotonic() - t0)
        print(f"  {mode:>11} proxy idle: {idle * 1e3:.2f} ms CPU per second", flush=True)
        runs = []
        for tokens in sizes:
            run = await run_size(stack.gateway_url, engine_url, proxy_pid, gateway_pid, tokens)
            run.proxy_idle_cpu_per_s = idle
            print(
                f"  {mode:>11} {tokens:>5} tokens x {run.requests:>3}: {run.wall_s:7.1f} s, "
                f"proxy {run.proxy_us_per_token():8.1f} us/token "
                f"({run.proxy_raw_us_per_token():.1f} before the idle correction), "
                f"engine {run.engine_bytes_per_token:9.0f} B/token",
                flush=True,
            )
            runs.append(run)
        return runs
    finally:
        if stack is not None:
            stack.stop()
        supervisor.terminate([[comp]], grace=10, procs={proc.pid: proc})  # type: ignore[dict-item]


def marginal(runs: list[Run]) -> list[float | None]:
    """Proxy CPU (us) each extra token costs from the previous length to this one."""
    out: list[float | None] = [None]
    for a, b in itertools.pairwise(runs):
        per_req_a = a.proxy_stream_cpu_s / a.requests
        per_req_b = b.proxy_stream_cpu_s / b.requests
        out.append((per_req_b - per_req_a) / (b.tokens - a.tokens) * 1e6)
    return out


def table(results: dict[str, list[Run]]) -> None:
    modes = list(results)
    print("\nProxy CPU per streamed token (us), from /proc/<pid>/stat over each run\n")
    head = "| tokens | " + " | ".join(
        f"{m}: proxy us/token | {m}: us per extra token | {m}: gateway us/token | "
        f"{m}: engine B/token"
        for m in modes
    )
    print(head + " |")
    print("|" + " --- |" * (1 + 4 * len(modes)))
    margins = {m: marginal(results[m]) for m in modes}
    sizes = sorted({r.tokens for runs in results.values() for r in runs})
    for n in sizes:
        cells = [str(n)]
        for m in modes:
            i = next((i for i, r in enumerate(results[m]) if r.tokens == n), None)
            if i is None:
                cells += ["not run", "", "", ""]
                continue
            r = results[m][i]
            extra = margins[m][i]
            cells += [
                f"{r.proxy_us_per_token():.1f}",
                "" if extra is None else f"{extra:.1f}",
                f"{r.gateway_us_per_token():.1f}",
                f"{r.engine_bytes_per_token:.0f}",
            ]
        print("| " + " | ".join(cells) + " |")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,256,1024,4096")
    ap.add_argument("--modes", default="cumulative,incremental")
    ap.add_argument(
        "--cumulative-max",
        type=int,
        default=0,
        help="skip cumulative runs longer than this (0: none skipped); on a loaded 2-core "
        "machine the engine itself slows to ~2 steps/s at 1,024 tokens in that mode",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    # SIGTERM unwinds like Ctrl-C, so the engine and the stack are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if max(sizes) + len(PROMPT) > CONTEXT:
        raise SystemExit(f"sizes must fit the {CONTEXT}-token context")
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="stream-cost-") as tmp:
        for mode in modes:
            todo = sizes
            if mode == "cumulative" and args.cumulative_max:
                todo = [n for n in sizes if n <= args.cumulative_max]
            results[mode] = await run_mode(Path(tmp), mode == "incremental", todo)
    table(results)


if __name__ == "__main__":
    asyncio.run(main())
