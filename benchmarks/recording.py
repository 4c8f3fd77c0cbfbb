"""Cost of RL recording: per-request overhead, write cost, export throughput.

    uv run python benchmarks/recording.py [--interactions 10000] [--requests 1000]

1. Store: write cost per interaction (SQLite WAL, committed per interaction as
   the proxy does before acknowledging) and export throughput (rows/s, MB/s)
   for `--interactions` interactions, individual and concat styles.
2. Through the real stack (router, gateway, proxy) in front of the *zero-cost
   fake engine*: the same chat with a session key (recorded) vs the admin key
   (not recorded), p50 latency and requests/s at concurrency 1 and 16.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402
from areal_proto.service.session_keys import mint_key, new_id  # noqa: E402
from areal_proxy.recording.model import Interaction  # noqa: E402
from areal_proxy.recording.sessions import SessionBook  # noqa: E402
from areal_proxy.recording.store import Store  # noqa: E402


def store_bench(n: int, tmp: Path) -> list[str]:
    book = SessionBook(Store(tmp / "bench.sqlite"), max_live=1000)
    turns_per_session = 4
    sessions = [(new_id("sess"), "") for _ in range(n // turns_per_session)]
    creds = [(sid, mint_key(sid)) for sid, _ in sessions]
    book.start("group-bench", "task", "m", creds)
    prompt = list(range(300))
    out_ids = list(range(100))

    async def write_all() -> float:
        t0 = time.perf_counter()
        for sid, _ in creds:
            msgs: list[dict] = [{"role": "user", "content": "q"}]
            prompt_ids: list[int] = list(prompt)
            session = book.store.session(sid)
            assert session is not None
            for _ in range(turns_per_session):
                turn = book.begin_turn(session, msgs)
                parent = turn.parent
                it = Interaction(
                    interaction_id="",
                    session_id=sid,
                    seq=0,
                    messages=msgs,
                    response={"role": "assistant", "content": "a" * 64},
                    prompt_ids=prompt_ids,
                    output_ids=out_ids,
                    logprobs=[-0.5] * 100,
                    versions=[3] * 100,
                    finish_reason="stop",
                    created_at=time.time(),
                    finished_at=time.time(),
                    parent_id=parent.interaction_id if parent else None,
                    inherited=len(parent.prompt_ids) + len(parent.output_ids) if parent else 0,
                )
                await book.record(it)
                msgs = [*msgs, it.response, {"role": "user", "content": "next"}]
                # The next turn continues this one's exact tokens (concat template).
                prompt_ids = [*prompt_ids, *out_ids, 1, 2, 3]
        return time.perf_counter() - t0

    write_s = asyncio.run(write_all())
    total = len(creds) * turns_per_session
    rows_out = []
    sessions_all = book.resolve_export([], "group-bench")
    for style in ("individual", "concat"):
        t0 = time.perf_counter()
        nbytes = nrows = 0
        for row in book.export_rows(sessions_all, style, 1.0):
            nbytes += len(orjson.dumps(row)) + 1
            nrows += 1
        dt = time.perf_counter() - t0
        rows_out.append(
            f"  export {style:<10} {nrows:>6} rows  {nrows / dt:>9.0f} rows/s  {nbytes / dt / 1e6:>7.1f} MB/s  ({nbytes / 1e6:.1f} MB)"
        )
    size = sum(p.stat().st_size for p in tmp.glob("bench.sqlite*")) / 1e6
    return [
        f"store: {total} interactions (300-token prompts growing per turn, 100-token outputs), SQLite {size:.0f} MB",
        f"  write (commit per interaction) {write_s / total * 1e6:>7.0f} us/interaction  {total / write_s:>7.0f} interactions/s",
        *rows_out,
    ]


async def load(url: str, key: str, n: int, conc: int) -> tuple[float, float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    body = orjson.dumps(
        {
            "model": "tiny-parrot",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
        }
    )
    async with httpx.AsyncClient(
        base_url=url, timeout=60, limits=httpx.Limits(max_connections=conc)
    ) as http:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await http.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(min(20, n))))
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    return statistics.median(lat) * 1e3, len(lat) / wall


def stack_bench(requests: int, tmp: Path) -> list[str]:
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    url = f"http://127.0.0.1:{engine.info['port']}"
    s = start_stack(
        tmp,
        url,
        ROOT / "models" / "tiny-parrot",
        n_proxies=1,
        gateway_args=["--log-level", "warning"],
        proxy_args=["--log-level", "warning"],
    )
    try:
        with httpx.Client(
            base_url=s.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as c:
            g = c.post("/rl/start_session", json={"task_id": "bench", "group_size": 1}).json()
        session_key = g["sessions"][0]["session_api_key"]
        out = [
            f"through the stack, zero-cost fake engine, chat with 16 output tokens ({requests} requests per row):"
        ]
        for conc in (1, 16):
            a_p50, a_rps = asyncio.run(load(s.gateway_url, ADMIN_KEY, requests, conc))
            s_p50, s_rps = asyncio.run(load(s.gateway_url, session_key, requests, conc))
            out.append(
                f"  c={conc:<3} admin key (not recorded) p50 {a_p50:6.2f} ms {a_rps:6.0f} req/s | "
                f"session key (recorded) p50 {s_p50:6.2f} ms {s_rps:6.0f} req/s | "
                f"recording adds {s_p50 - a_p50:+.2f} ms p50, rps x{s_rps / a_rps:.2f}"
            )
        return out
    finally:
        s.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interactions", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="areal-rec-bench-") as d:
        lines = store_bench(args.interactions, Path(d))
    with tempfile.TemporaryDirectory(prefix="areal-rec-stack-") as d:
        lines += stack_bench(args.requests, Path(d))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
