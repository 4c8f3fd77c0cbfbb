"""What SGLang's `--stream-interval` costs a client: time to first token and inter-token gaps.

    uv run python benchmarks/stream_interval.py [--intervals 1,4,16] [--streams 8] [--tokens 128]

Starts the CPU SGLang engine serving the tiny parrot model (as benchmarks/stream_cost.py
does, `--incremental-streaming-output` on, as areal starts it) once per interval, one at a
time, and streams `--streams` concurrent `/generate` requests of `--tokens` tokens straight
to it (no areal in between: the knob is the engine's). Prints per interval the p50 time to
first token, p50/p99 of the gap between events, tokens per event, the answer's p50 time, and
the engine's events per second; ratios against interval 1. Fewer, larger events are what
the proxy and gateway pay per event for; the price is the gap a client sees.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from stream_cost import PROMPT, start_engine  # noqa: E402

from areal_cli import supervisor  # noqa: E402


async def measure(url: str, streams: int, tokens: int) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    ttft: list[float] = []
    gaps: list[float] = []
    answers: list[float] = []
    events = 0

    async def one(s: aiohttp.ClientSession) -> None:
        nonlocal events
        t0 = time.perf_counter()
        last = None
        async with s.post(url + "/generate", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                events += 1
                if last is None:
                    ttft.append(now - t0)
                else:
                    gaps.append(now - last)
                last = now
        answers.append(time.perf_counter() - t0)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await one(s)  # warm-up
        ttft.clear()
        gaps.clear()
        answers.clear()
        events = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for _ in range(streams)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [float("nan")] * 99
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "gap_p50_ms": q[49] * 1e3,
        "gap_p99_ms": q[98] * 1e3,
        "tokens_per_event": streams * tokens / events,
        "answer_p50_s": statistics.median(answers),
        "events_per_s": events / wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="1,4,16")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="areal-stream-interval-"))
    rows = []
    for k in [int(x) for x in args.intervals.split(",")]:
        url, comp, proc = start_engine(tmp, True, ["--stream-interval", str(k)])
        try:
            r = asyncio.run(measure(url, args.streams, args.tokens))
        finally:
            supervisor.terminate([[comp]], grace=5, procs={proc.pid: proc})  # type: ignore[dict-item]
        rows.append((k, r))
        print(f"stream-interval {k}: {r}", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(
        f"\nSGLang --stream-interval on the CPU engine (tiny parrot), {args.streams} streams x "
        f"{args.tokens} tokens straight to /generate; load average {load[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end\n"
    )
    print(
        "| interval | TTFT p50 ms | gap p50 / p99 ms | tokens/event | answer p50 s "
        "(vs 1) | events/s (vs 1) |"
    )
    print("| ---: | ---: | --- | ---: | --- | --- |")
    for k, r in rows:
        print(
            f"| {k} | {r['ttft_p50_ms']:.0f} | {r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} "
            f"| {r['tokens_per_event']:.1f} | {r['answer_p50_s']:.2f} "
            f"({r['answer_p50_s'] / base['answer_p50_s']:.2f}x) | {r['events_per_s']:.0f} "
            f"({r['events_per_s'] / base['events_per_s']:.2f}x) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
