"""Disk per turn of a long RL session: does it stay flat from turn 1 to turn 500?

    uv run python benchmarks/proxy_growth.py [--turns 500] [--templates hf,concat]

A real router, gateway and one data proxy (tests/e2e/stack.py, the code the CLI uses) in
front of the *zero-cost fake engine* (benchmarks/fake_engine.py, 16 tokens per answer). One
session key has one conversation of `--turns` turns: each turn sends the whole conversation
so far (the system prompt, every question, every answer echoed back) plus a new ~90-character
question, as an agent does. After chosen turns it reads the proxy's SQLite file (pages in use
x page size, WAL included: what a reader sees) and prints, per window of turns, the bytes the
database grew per turn and the turn's latency; then the export's size, to show what was
recorded is all there.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import launch, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

MARKS = (1, 2, 5, 10, 50, 100, 200, 300, 400, 500, 750, 1000)


def db_bytes(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        pages, free, size = (
            db.execute(f"PRAGMA {p}").fetchone()[0]
            for p in ("page_count", "freelist_count", "page_size")
        )
        return (pages - free) * size
    finally:
        db.close()


def run(tmp: Path, engine_url: str, template: str, turns: int) -> list[str]:
    stack = start_stack(
        tmp / template,
        engine_url,
        ROOT / "models" / "tiny-parrot",
        n_proxies=1,
        gateway_args=["--log-level", "warning"],
        # The conversation outgrows the model's 2048 tokens by turn ~40; the fake engine has
        # no context limit.
        proxy_args=[
            "--log-level",
            "warning",
            "--chat-template-type",
            template,
            "--context-length",
            "10000000",
        ],
        router_args=["--log-level", "warning"],
    )
    db = tmp / template / "tiny-parrot-data-proxy-0.sqlite"
    lines = []
    try:
        with stack.admin() as admin:
            g = admin.post("/rl/start_session", json={"task_id": "long", "group_size": 1}).json()
            sid = g["sessions"][0]["session_id"]
            key = g["sessions"][0]["session_api_key"]
            msgs = [{"role": "system", "content": "You are a helpful assistant. Be brief."}]
            with httpx.Client(
                base_url=stack.gateway_url,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            ) as c:
                base = db_bytes(db)
                prev_turn, prev_bytes, lat = 0, base, []
                for turn in range(1, turns + 1):
                    msgs.append(
                        {
                            "role": "user",
                            "content": f"Question {turn}: what is {turn} times 7, and why "
                            "does it matter for the next step?",
                        }
                    )
                    t0 = time.perf_counter()
                    r = c.post(
                        "/v1/chat/completions",
                        json={"model": "tiny-parrot", "messages": msgs, "max_tokens": 16},
                    )
                    lat.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    msgs.append(r.json()["choices"][0]["message"])
                    if turn in MARKS or turn == turns:
                        now = db_bytes(db)
                        per = (now - prev_bytes) / (turn - prev_turn)
                        body = len(httpx.Request("POST", "/", json={"messages": msgs}).content)
                        lines.append(
                            f"{template:<7} turns {prev_turn + 1:>4}-{turn:<4} | "
                            f"{per:>10,.0f} B/turn | db {now / 1e6:>8.2f} MB | "
                            f"turn p50 {statistics.median(lat) * 1e3:>7.2f} ms | "
                            f"request body {body / 1e3:>7.1f} kB"
                        )
                        prev_turn, prev_bytes, lat = turn, now, []
                        print(lines[-1], flush=True)
            t0 = time.perf_counter()
            e = admin.post(
                "/rl/export_trajectories",
                json={"session_ids": [sid], "style": "individual"},
                timeout=600,
            )
            if e.status_code != 200:
                lines.append(f"{template:<7} export FAILED: {e.status_code} {e.text[:200]}")
            else:
                rows = e.json()["rows"]
                tokens = sum(len(r["input_ids"]) for r in rows)
                lines.append(
                    f"{template:<7} export: {len(rows)} rows, {tokens:,} tokens in all, "
                    f"{len(e.content) / 1e6:.1f} MB of JSON in {time.perf_counter() - t0:.2f} s"
                )
            print(lines[-1], flush=True)
    finally:
        stack.stop()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=500)
    ap.add_argument("--templates", default="hf,concat")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="areal-growth-"))
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    url = f"http://127.0.0.1:{engine.info['port']}"
    lines = []
    try:
        for template in args.templates.split(","):
            lines += run(tmp, url, template, args.turns)
    finally:
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    print(
        f"\none session, {args.turns} turns through the gateway (zero-cost fake engine, 16 "
        "tokens per answer); proxy SQLite growth per turn:"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
