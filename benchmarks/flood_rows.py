"""Floods of bodies that are costly to parse, beside ordinary chats: do others stall?

    uv run python benchmarks/flood_rows.py [--flood-s 15] [--senders 4] [--rows quiet,growth,...]
        [--json out.json]

Against a running inference service (`fault_table.py` calls `run_floods` on its own; run alone,
this starts `areal inf run --backend sglang:d1` with the CPU SGLang engine, like fault_table).
Ordinary traffic throughout each row: 4 threads of RL-session chats (`/rl/start_session`, then
chats of 4 tokens with the session key, one at a time) and `GET /health` every 0.2 s. Rows:

* quiet: the ordinary traffic alone, for reference;
* gradual growth then flood: one session key sends a chat whose `metadata` holds a list of
  empty objects, grown by 250 KiB a turn (each turn within the long-session allowance of
  256 KiB) up to 7 MB or until refused; then `--senders` threads send the 7 MB body for
  `--flood-s` seconds; and again, flooding instead the largest body answered during the
  growth (what such a session may still send);
* Messages 7 MB: `--senders` threads send a `/v1/messages` body of 280 k empty text blocks;
* Responses 7 MB: `--senders` threads send a `/v1/responses` body of 240 k small input items;
* 7 MB of prose on chat and on Responses (admin key): a big body of ordinary shape, for
  comparison (the prompt cannot fit the model's context: each is a 400 once read).

Per row: the big bodies sent and their statuses, the others' chats (n, errors, p50 / p99 /
max ms) and `/health` (p50 / max ms) during the row.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

MODEL = "tiny-parrot"
KEY = "fault-admin-key"
GROW_STEP = 250 * 1024
GROW_MAX = 7_000_000


class Others:
    """Ordinary chats on their own session keys, and /health, until stopped."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.chats: list[float] = []
        self.errors: list[str] = []
        self.health: list[float] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._chat, daemon=True) for _ in range(threads)]
        self.threads.append(threading.Thread(target=self._health, daemon=True))

    def __enter__(self) -> Others:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _chat(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            key = _session_key(c)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    r = c.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    status = str(r.status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with self.lock:
                    if status == "200":
                        self.chats.append((time.perf_counter() - t) * 1000)
                    else:
                        self.errors.append(status)

    def _health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    c.get("/health")
                    self.health.append((time.perf_counter() - t) * 1000)
                except httpx.HTTPError:
                    self.health.append(float("inf"))
                self.stop.wait(0.2)

    def row(self) -> dict[str, Any]:
        lat = sorted(self.chats)
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99 or [0.0] * 99
        return {
            "others_n": len(lat),
            "others_errors": dict(collections.Counter(self.errors)),
            "others_p50_ms": round(statistics.median(lat), 1) if lat else None,
            "others_p99_ms": round(q[98], 1),
            "others_max_ms": round(lat[-1], 1) if lat else None,
            "health_p50_ms": round(statistics.median(self.health), 1) if self.health else None,
            "health_max_ms": round(max(self.health), 1) if self.health else None,
        }


def _session_key(c: httpx.Client) -> str:
    r = c.post(
        "/rl/start_session",
        json={"task_id": "flood", "group_size": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    r.raise_for_status()
    return r.json()["sessions"][0]["session_api_key"]


def _flood(
    url: str, path: str, body: bytes, headers: dict[str, str], senders: int, seconds: float
) -> collections.Counter[str]:
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def send() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < end:
                try:
                    status = str(
                        c.post(
                            path,
                            content=body,
                            headers={**headers, "content-type": "application/json"},
                        ).status_code
                    )
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=send, daemon=True) for _ in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 180)
    return statuses


def _growth_body(n: int) -> bytes:
    doc = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "metadata": {"pad": [{}] * n},
    }
    return orjson.dumps(doc)


def growth_then_flood(
    url: str, senders: int, seconds: float, largest: bool = False
) -> dict[str, Any]:
    """The growth, then the flood of a 7 MB body of it; with `largest`, of the largest body
    the service answered during the growth instead (what such a session may still send)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        key = _session_key(c)
        auth = {"Authorization": f"Bearer {key}"}
        n, grown, refused_at = 0, 0, None
        while True:
            body = _growth_body(n)
            if len(body) > GROW_MAX:
                break
            r = c.post("/v1/chat/completions", content=body, headers=auth)
            if r.status_code != 200:
                refused_at = f"{len(body) // 1024} KiB: {r.status_code} {r.json()['error']['code']}"
                break
            grown = len(body)
            n += GROW_STEP // 3  # `{},` is 3 bytes
    if largest:  # what is left: the largest body the service still answered, flooded
        big = _growth_body(max(0, n - GROW_STEP // 3))
        scenario = f"growth: flood of the largest body answered ({len(big) // 1024} KiB)"
    else:
        big = _growth_body((GROW_MAX - 200) // 3)
        scenario = "gradual growth then flood (chat, session key)"
    with Others(url) as others:
        statuses = _flood(url, "/v1/chat/completions", big, auth, senders, seconds)
    return {
        "scenario": scenario,
        "grown_to_kib": grown // 1024,
        "refused_at": refused_at,
        "big_kb": len(big) // 1000,
        "big_statuses": dict(statuses),
        **others.row(),
    }


def messages_flood(url: str, senders: int, seconds: float) -> dict[str, Any]:
    blocks = [{"type": "text", "text": ""}] * 280_000
    doc = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    big = orjson.dumps(doc)
    with Others(url) as others:
        statuses = _flood(url, "/v1/messages", big, {"x-api-key": KEY}, senders, seconds)
    return {
        "scenario": "Messages 7 MB (280k empty text blocks)",
        "big_kb": len(big) // 1000,
        "big_statuses": dict(statuses),
        **others.row(),
    }


def responses_flood(url: str, senders: int, seconds: float) -> dict[str, Any]:
    items = [{"role": "user", "content": "a"}] * 240_000
    big = orjson.dumps({"model": MODEL, "input": items, "max_output_tokens": 4})
    with Others(url) as others:
        statuses = _flood(
            url, "/v1/responses", big, {"Authorization": f"Bearer {KEY}"}, senders, seconds
        )
    return {
        "scenario": "Responses 7 MB (240k small input items)",
        "big_kb": len(big) // 1000,
        "big_statuses": dict(statuses),
        **others.row(),
    }


def prose_flood(url: str, path: str, senders: int, seconds: float) -> dict[str, Any]:
    """7 MB of prose (one message) on `path`: what a big body of ordinary shape costs."""
    text = ("lorem ipsum dolor sit amet " * 260_000)[:7_000_000]
    if path == "/v1/responses":
        doc: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 4}
    else:
        doc = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    big = orjson.dumps(doc)
    with Others(url) as others:
        statuses = _flood(url, path, big, {"Authorization": f"Bearer {KEY}"}, senders, seconds)
    return {
        "scenario": f"{path} 7 MB of prose (admin key)",
        "big_kb": len(big) // 1000,
        "big_statuses": dict(statuses),
        **others.row(),
    }


def quiet(url: str, seconds: float) -> dict[str, Any]:
    with Others(url) as others:
        time.sleep(seconds)
    return {"scenario": "quiet (ordinary traffic alone)", **others.row()}


def run_floods(
    url: str, senders: int = 4, seconds: float = 15.0, only: str = ""
) -> list[dict[str, Any]]:
    """The rows (`only`: a comma-separated subset of their names), each a dict."""
    plan = {
        "quiet": lambda: quiet(url, seconds),
        "growth": lambda: growth_then_flood(url, senders, seconds),
        "largest": lambda: growth_then_flood(url, senders, seconds, largest=True),
        "messages": lambda: messages_flood(url, senders, seconds),
        "responses": lambda: responses_flood(url, senders, seconds),
        "chat-prose": lambda: prose_flood(url, "/v1/chat/completions", senders, seconds),
        "responses-prose": lambda: prose_flood(url, "/v1/responses", senders, seconds),
    }
    rows = []
    for name, fn in plan.items():
        if only and name not in only.split(","):
            continue
        rows.append(fn())
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


HEAD = [
    "scenario",
    "big_statuses",
    "others_n",
    "others_errors",
    "others_p50_ms",
    "others_p99_ms",
    "others_max_ms",
    "health_p50_ms",
    "health_max_ms",
]


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "|".join("---" for _ in HEAD) + "|")
    for r in rows:
        print("| " + " | ".join(str(r.get(h, "")) for h in HEAD) + " |")
    for r in rows:
        if "grown_to_kib" in r:
            print(f"  growth: accepted up to {r['grown_to_kib']} KiB; refused at {r['refused_at']}")


def main(argv: list[str] | None = None) -> int:
    # Imported here: run_floods needs only a URL (fault_table.py owns the service there).
    from fault_table import PARROT, Areal

    p = argparse.ArgumentParser()
    p.add_argument("--flood-s", type=float, default=15.0)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--rows", default="", help="only these rows: quiet,growth,largest,...")
    p.add_argument("--json", default="")
    a_ = p.parse_args(argv)
    a = Areal(Path(tempfile.mkdtemp(prefix="areal-floods-")))
    r = a(
        "inf", "run", "--model", MODEL, "--backend", "sglang:d1", "--model-path", str(PARROT),
        "--detach", "--port", "0", "--admin-api-key", KEY,
    )  # fmt: skip
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    try:
        rows = run_floods(a.state("inf")["gateway"]["url"], a_.senders, a_.flood_s, a_.rows)
    finally:
        a("inf", "stop", "--force")
    print_rows(rows)
    if a_.json:
        Path(a_.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
