"""Throughput of SmolLM2-135M-Instruct on the CPU SGLang engine: direct vs through areal.

    uv run python benchmarks/real_model.py [--tokens 32] [--requests-c1 4] [--requests-c16 16]

Starts one SGLang engine on the model scripts/setup-model.sh set up (`smollm2`) and a stack
in front of it (router, gateway, one data proxy; tests/e2e/stack.py). The same prompt token
ids go to the engine's own `/generate` and to the gateway's `/v1/completions` (greedy, so both
generate the same tokens), at concurrency 1 and 16, non-stream and stream. Prints output
tokens/s and requests/s for each, and areal's overhead in percent of the direct figure
(positive = slower through areal). Direct and areal runs alternate per row, so a change in
what else the machine runs hits both sides of a row alike; it still moves the absolute
numbers (the engine, areal and this client share the machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, start_stack  # noqa: E402

from areal_cli import engines, supervisor  # noqa: E402
from areal_cli.errors import CLIError  # noqa: E402
from areal_cli.models import resolve_short_name  # noqa: E402

MODEL = "smol"
# A chat prompt (SmolLM2's template, its default system turn included), as token ids.
PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a short story about a robot who learns to paint."
    "<|im_end|>\n<|im_start|>assistant\n"
)


def start_engine(folder: Path, log_dir: Path) -> tuple[str, supervisor.Component, object]:
    python = engines.resolve_python("sglang")
    port = supervisor.free_port()
    launch = engines.engine_launch(
        "sglang",
        python=python,
        model_path=str(folder),
        served_name=MODEL,
        host="127.0.0.1",
        port=port,
        extra_args=engines.SGLANG_CPU_ARGS.split(),
    )
    proc, comp = supervisor.spawn(
        "smol-engine", launch.argv, log_dir / "engine.log", env=launch.env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        supervisor.wait_ready(proc, comp, lambda: supervisor.http_ok(url + launch.health_path), 600)
    except BaseException:
        supervisor.terminate([[comp]], grace=5, procs={proc.pid: proc})
        raise
    return url, comp, proc


def completion_tokens(payload: dict, direct: bool, chunks: int = 0) -> int:
    """Output tokens of a response (a stream's last chunk; its chunk count if that has none)."""
    if direct:
        return int(payload["meta_info"]["completion_tokens"])
    usage = payload.get("usage") or {}
    return int(usage.get("completion_tokens") or chunks)


async def run_load(
    url: str, body: bytes, headers: dict, n: int, conc: int, stream: bool, direct: bool
) -> dict:
    """n requests, conc at a time; wall time, output tokens and latencies."""
    lat: list[float] = []
    ttft: list[float] = []
    tokens = 0
    errors = 0
    sem = asyncio.Semaphore(conc)
    timeout = aiohttp.ClientTimeout(total=1800)
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn, headers=headers, timeout=timeout) as http:

        async def one() -> None:
            nonlocal tokens, errors
            async with sem:
                t0 = time.perf_counter()
                async with http.post(url, data=body) as r:
                    if r.status != 200:
                        errors += 1
                        print(f"  HTTP {r.status}: {(await r.text())[:200]}", file=sys.stderr)
                        return
                    chunks = 0
                    if not stream:
                        payload = orjson.loads(await r.read())
                    else:
                        payload = None
                        async for line in r.content:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                continue
                            if payload is None:
                                ttft.append(time.perf_counter() - t0)
                            payload = orjson.loads(data)
                            chunks += bool(payload.get("choices"))
                        assert payload is not None, "empty stream"
                    tokens += completion_tokens(payload, direct, chunks)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    out = {
        "wall": wall,
        "tok_s": tokens / wall,
        "req_s": len(lat) / wall,
        "p50": statistics.median(lat) if lat else 0.0,
        "tokens": tokens,
        "errors": errors,
    }
    if ttft:
        out["ttft"] = statistics.median(ttft)
    return out


def pct(via: float, direct: float) -> str:
    """areal's overhead: how much lower areal's rate is than the direct one, in percent."""
    return f"{(direct - via) / direct * 100:+.1f}%" if direct else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens per request")
    ap.add_argument("--requests-c1", type=int, default=4)
    ap.add_argument("--requests-c16", type=int, default=16)
    ap.add_argument("--model-path", default="smollm2", help="model folder or short name")
    args = ap.parse_args()
    if min(args.tokens, args.requests_c1, args.requests_c16) < 1:
        ap.error("--tokens and the request counts must be at least 1")
    try:
        folder = Path(resolve_short_name(args.model_path) or args.model_path).resolve()
    except CLIError as e:
        ap.error(str(e))
    if not (folder / "tokenizer.json").is_file():
        ap.error(f"{folder} is not a model folder with tokenizer.json")
    from tokenizers import Tokenizer

    ids = (
        Tokenizer.from_file(str(folder / "tokenizer.json"))
        .encode(PROMPT, add_special_tokens=False)
        .ids
    )

    tmp = Path(tempfile.mkdtemp(prefix="areal-bench-real-"))
    t0 = time.monotonic()
    engine_url, comp, proc = start_engine(folder, tmp)
    print(f"engine healthy in {time.monotonic() - t0:.0f}s; logs in {tmp}", flush=True)
    stack = None
    try:
        stack = start_stack(
            tmp,
            engine_url,
            folder,
            model=MODEL,
            n_proxies=1,
            gateway_args=["--log-level", "warning"],
            proxy_args=["--log-level", "warning"],
            router_args=["--log-level", "warning"],
        )
        direct_h = {"Content-Type": "application/json"}
        via_h = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_KEY}"}
        rows = []
        for stream in (False, True):
            eng_body = orjson.dumps(
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0},
                    "return_logprob": True,
                    "stream": stream,
                }
            )
            gw = {
                "model": MODEL,
                "prompt": ids,
                "max_tokens": args.tokens,
                "temperature": 0,
                "stream": stream,
            }
            if stream:
                gw["stream_options"] = {"include_usage": True}
            gw_body = orjson.dumps(gw)
            # Warm-up: one request each way (first-request costs, the prefix cache).
            asyncio.run(run_load(engine_url + "/generate", eng_body, direct_h, 1, 1, stream, True))
            asyncio.run(
                run_load(stack.gateway_url + "/v1/completions", gw_body, via_h, 1, 1, stream, False)
            )
            for conc, n in ((1, args.requests_c1), (16, args.requests_c16)):
                e = asyncio.run(
                    run_load(engine_url + "/generate", eng_body, direct_h, n, conc, stream, True)
                )
                g = asyncio.run(
                    run_load(
                        stack.gateway_url + "/v1/completions",
                        gw_body,
                        via_h,
                        n,
                        conc,
                        stream,
                        False,
                    )
                )
                mode = "stream" if stream else "non-stream"
                rows.append((mode, conc, n, e, g))
                print(
                    f"  {mode} c={conc}: direct {e['tok_s']:.1f} tok/s, areal {g['tok_s']:.1f}",
                    flush=True,
                )
        print(
            f"\nSmolLM2-135M-Instruct on CPU SGLang: engine direct vs areal "
            f"(gateway -> router -> proxy); prompt {len(ids)} tokens, up to {args.tokens} "
            f"new, greedy; overhead = how much lower areal's rate is\n"
        )
        hdr = (
            f"{'mode':<11}{'c':>3}{'n':>4} | {'direct tok/s':>12} {'req/s':>6} {'p50 s':>6} | "
            f"{'areal tok/s':>11} {'req/s':>6} {'p50 s':>6} | {'tok/s ovh':>9} {'req/s ovh':>9}"
        )
        print(hdr)
        print("-" * len(hdr))
        for mode, conc, n, e, g in rows:
            print(
                f"{mode:<11}{conc:>3}{n:>4} | {e['tok_s']:>12.1f} {e['req_s']:>6.2f} "
                f"{e['p50']:>6.2f} | {g['tok_s']:>11.1f} {g['req_s']:>6.2f} {g['p50']:>6.2f} | "
                f"{pct(g['tok_s'], e['tok_s']):>9} {pct(g['req_s'], e['req_s']):>9}"
            )
            if mode == "stream":
                print(
                    f"{'':<18} | ttft p50 {e.get('ttft', 0):.2f}s{'':<13} | "
                    f"ttft p50 {g.get('ttft', 0):.2f}s"
                )
            if e["errors"] or g["errors"]:
                print(f"{'':<18} errors: direct {e['errors']}, areal {g['errors']}")
            if e["tokens"] != g["tokens"]:
                print(f"{'':<18} output tokens: direct {e['tokens']}, areal {g['tokens']}")
    finally:
        if stack is not None:
            stack.stop()
        supervisor.terminate([[comp]], grace=10, procs={proc.pid: proc})  # type: ignore[dict-item]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
