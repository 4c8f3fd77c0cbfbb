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
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from gateway_overhead import cpu_seconds, run_load  # noqa: E402
from stack import ADMIN_KEY, Stack, launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402
from areal_proxy.common.records import Interaction  # noqa: E402
from areal_proxy.recording.sessions import SessionBook  # noqa: E402
from areal_proxy.recording.store import Store  # noqa: E402
from areal_runtime.session_keys import mint_key, new_id  # noqa: E402


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


def _load(s: Stack, key: str, n: int, conc: int, pids: dict[str, int]) -> dict:
    """One row: `n` chats at `conc`, with the areal processes' CPU per request (ms)."""
    body = orjson.dumps(
        {
            "model": "tiny-parrot",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
        }
    )
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
    out = asyncio.run(
        run_load(s.gateway_url + "/v1/chat/completions", body, headers, n, conc, False)
    )
    if out["errors"]:
        raise SystemExit(f"{out['errors']} of {n} requests failed")
    # (The warm-up's requests are counted in the CPU too: a bound that errs high.)
    per = {k: (cpu_seconds(pid) - before[k]) / n * 1e3 for k, pid in pids.items()}
    out["cpu"] = sum(per.values())
    out["by"] = "/".join(f"{per[k]:.2f}" for k in ("gateway", "router", "proxy"))
    return out


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
    pids = {"gateway": s.gateway.comp.pid, "router": s.router.comp.pid}
    pids["proxy"] = s.proxies[0].comp.pid
    try:
        with httpx.Client(
            base_url=s.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as c:
            g = c.post("/rl/start_session", json={"task_id": "bench", "group_size": 1}).json()
        session_key = g["sessions"][0]["session_api_key"]
        out = [
            f"through the stack, zero-cost fake engine, chat with 16 output tokens ({requests} "
            "requests per row; CPU: gateway + router + proxy per request, and each g/r/p):"
        ]
        # Every recorded request joins the same session with the same prompt, so the session
        # grows by one interaction a request (upstream's recording slowed down as it grew).
        history = 0
        for conc in (1, 16, 64):
            a = _load(s, ADMIN_KEY, requests, conc, pids)
            r = _load(s, session_key, requests, conc, pids)
            out.append(
                f"  c={conc:<3} admin key (not recorded) p50 {a['p50']:6.2f} ms {a['rps']:5.0f} req/s "
                f"CPU {a['cpu']:.2f} ({a['by']}) ms | session key (recorded) p50 {r['p50']:6.2f} ms "
                f"{r['rps']:5.0f} req/s CPU {r['cpu']:.2f} ({r['by']}) ms | recording adds "
                f"{r['p50'] - a['p50']:+.2f} ms p50, {r['cpu'] - a['cpu']:+.2f} ms CPU "
                f"(session held {history} interactions before)"
            )
            history += requests + min(50, requests)
        out.append("  one session growing, recorded, c=64:")
        for _ in range(3):
            r = _load(s, session_key, requests, 64, pids)
            out.append(
                f"    {history:>6} interactions before: p50 {r['p50']:6.2f} ms "
                f"{r['rps']:5.0f} req/s CPU {r['cpu']:.2f} ({r['by']}) ms"
            )
            history += requests + min(50, requests)
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
