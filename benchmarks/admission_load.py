"""Admission under load: 1,000 start_session calls against a bound of 64 in flight, while
the weights are updated (docs/services.md, "Admission").

    uv run python benchmarks/admission_load.py [--calls 1000] [--bound 64] [--clients 128]

A real router, gateway and two data proxies in front of the zero-cost fake engine (the
engine plays no part in a start; its weight update succeeds at once, so an update costs
only areal's pause, version and continue). The model gets max_concurrent_rollouts = bound
and a staleness bound (max_staleness 1, batch_size = bound). `clients` rollout workers make
`calls` start_session calls in all; an admitted session is held a few ms, ended, exported
with removal and acknowledged (consumed). A trainer loop updates the weights
(`/admin/update_weights`, version + 1) each time a batch has been consumed, and a sampler
reads the router's counts every 10 ms. Three phases, one run:

- off: no bounds (today's default), the baseline for a start's latency;
- refuse: wait_s 0, a refused call is a 429 (counted, never retried);
- wait: wait_s 10, a call waits for room instead.

It checks: every refusal is a 429 with an integer Retry-After and code capacity_exhausted
or staleness_bound; the sessions running never exceed the bound (the sampler, and the
clients' own count); running + ended + consumed never exceeds (1 + version + 1) x batch.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import ADMIN_KEY, launch, start_stack  # noqa: E402

MODEL = "tiny-parrot"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STALENESS = 1


@dataclass
class Phase:
    name: str
    wait_s: float
    bounded: bool
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    bad_refusals: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    client_running: int = 0
    client_max_running: int = 0
    max_running: int = 0
    max_over_staleness: int = -(10**9)
    updates: int = 0
    update_s: list[float] = field(default_factory=list)
    consumed: int = 0
    wall_s: float = 0.0


async def admission(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/admin/models/{MODEL}/admission", headers=ADMIN) as r:
        return await r.json()


async def rollout(
    http: aiohttp.ClientSession, url: str, phase: Phase, calls: list[int], done: asyncio.Event
) -> None:
    while calls:
        calls.pop()
        body = {"model": MODEL, "group_size": 1, "wait_s": phase.wait_s}
        t0 = time.perf_counter()
        async with http.post(f"{url}/rl/start_session", json=body, headers=ADMIN) as r:
            doc = await r.json()
            status, retry = r.status, r.headers.get("retry-after", "")
        if status == 429:
            code = str(doc.get("error", {}).get("code"))
            phase.refused[code] = phase.refused.get(code, 0) + 1
            if not retry.isdigit() or code not in ("capacity_exhausted", "staleness_bound"):
                phase.bad_refusals.append(f"{code} retry-after={retry!r}")
            continue
        if status != 201:
            phase.bad_refusals.append(f"HTTP {status}: {doc}")
            continue
        phase.latencies.append(time.perf_counter() - t0)
        phase.admitted += 1
        phase.client_running += 1
        phase.client_max_running = max(phase.client_max_running, phase.client_running)
        session = doc["sessions"][0]
        key = {"Authorization": f"Bearer {session['session_api_key']}"}
        await asyncio.sleep(random.uniform(0.0, 0.02))  # the rollout
        async with http.post(f"{url}/rl/end_session", headers=key) as r:
            assert r.status == 200, await r.text()
        phase.client_running -= 1
        exp_body = {"group_id": doc["group_id"], "remove_session": True}
        async with http.post(f"{url}/rl/export_trajectories", json=exp_body, headers=ADMIN) as r:
            export_id = (await r.json())["export_id"]
        async with http.post(
            f"{url}/rl/ack_export", json={"export_id": export_id}, headers=ADMIN
        ) as r:
            assert r.status == 200, await r.text()
    done.set()


async def trainer(
    http: aiohttp.ClientSession, url: str, phase: Phase, batch: int, stop: asyncio.Event
) -> None:
    """Update the weights each time a batch more has been consumed (as a trainer would)."""
    version = 0
    while not stop.is_set():
        st = await admission(http, url)
        if st["consumed"] >= (version + 1) * batch:
            t0 = time.perf_counter()
            async with http.post(
                f"{url}/admin/update_weights",
                json={"model": MODEL, "path": "/fake/checkpoint"},
                headers=ADMIN,
            ) as r:
                doc = await r.json()
                assert r.status == 200, doc
            phase.update_s.append(time.perf_counter() - t0)
            version = int(doc["version"])
            phase.updates += 1
        else:
            await asyncio.sleep(0.01)


async def sampler(http: aiohttp.ClientSession, url: str, phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        st = await admission(http, url)
        phase.max_running = max(phase.max_running, st["running"])
        if st["batch_size"] is not None:
            limit = (STALENESS + st["version"] + 1) * st["batch_size"]
            used = st["running"] + st["ended"] + st["consumed"]
            phase.max_over_staleness = max(phase.max_over_staleness, used - limit)
        phase.consumed = st["consumed"]
        await asyncio.sleep(0.01)


async def run_phase(url: str, phase: Phase, args: argparse.Namespace) -> Phase:
    conn = aiohttp.TCPConnector(limit=args.clients + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(60)) as http:
        bounds: dict[str, Any] = {
            "max_concurrent_rollouts": None,
            "max_staleness": None,
            "batch_size": None,
            "reset_consumed": True,
        }
        if phase.bounded:
            bounds.update(
                max_concurrent_rollouts=args.bound,
                max_staleness=STALENESS,
                batch_size=args.bound,
            )
        async with http.put(
            f"{url}/admin/models/{MODEL}/admission", json=bounds, headers=ADMIN
        ) as r:
            assert r.status == 200, await r.text()
        # Each phase starts at version 0. A health poll answered just before a lower
        # set_version can raise the rule's version back once: set it again after a poll.
        for _ in range(2):
            async with http.post(
                f"{url}/admin/set_version", json={"model": MODEL, "version": 0}, headers=ADMIN
            ) as r:
                assert r.status == 200, await r.text()
            await asyncio.sleep(1.0)
        stop = asyncio.Event()
        calls = list(range(args.calls))
        dones = [asyncio.Event() for _ in range(args.clients)]
        t0 = time.perf_counter()
        side = [
            asyncio.create_task(sampler(http, url, phase, stop)),
            asyncio.create_task(trainer(http, url, phase, args.bound, stop)),
        ]
        await asyncio.gather(*(rollout(http, url, phase, calls, d) for d in dones))
        phase.wall_s = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*side)
    return phase


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def main_async(url: str, args: argparse.Namespace) -> list[Phase]:
    phases = [
        Phase("off", 0.0, bounded=False),
        Phase("refuse", 0.0, bounded=True),
        Phase("wait", 10.0, bounded=True),
    ]
    for p in phases:
        await run_phase(url, p, args)
    return phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--bound", type=int, default=64)
    ap.add_argument("--clients", type=int, default=128)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="areal-bench-admission-"))
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    stack = None
    try:
        stack = start_stack(
            tmp,
            f"http://127.0.0.1:{engine.info['port']}",
            ROOT / "models" / MODEL,
            n_proxies=2,
            gateway_args=["--log-level", "warning"],
            proxy_args=["--log-level", "warning"],
            router_args=["--log-level", "warning"],
        )
        phases = asyncio.run(main_async(stack.gateway_url, args))
    finally:
        if stack is not None:
            stack.stop()
        from areal_cli import supervisor

        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    print(
        f"{args.calls} start_session calls, {args.clients} clients, bound {args.bound} in flight, "
        f"max_staleness {STALENESS}, batch_size {args.bound}; zero-cost fake engine, 2 proxies"
    )
    head = (
        f"{'phase':<7} {'admitted':>8} {'refused':>24} {'bad 429':>7} {'max run':>7} "
        f"{'client max':>10} {'stale over':>10} {'updates':>7} {'upd p50 ms':>10} "
        f"{'start p50 ms':>12} {'p99 ms':>7} {'wall s':>6}"
    )
    print(head)
    ok = True
    for p in phases:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(p.refused.items())) or "0"
        over = "-" if p.max_over_staleness < -(10**8) else str(p.max_over_staleness)
        upd = statistics.median(p.update_s) * 1000 if p.update_s else float("nan")
        print(
            f"{p.name:<7} {p.admitted:>8} {refused:>24} {len(p.bad_refusals):>7} "
            f"{p.max_running:>7} {p.client_max_running:>10} {over:>10} {p.updates:>7} "
            f"{upd:>10.1f} {pct(p.latencies, 0.5):>12.1f} {pct(p.latencies, 0.99):>7.1f} "
            f"{p.wall_s:>6.1f}"
        )
        if p.bad_refusals:
            ok = False
            print("  bad:", p.bad_refusals[:5])
        if p.bounded and (
            p.max_running > args.bound
            or p.client_max_running > args.bound
            or p.max_over_staleness > 0
        ):
            ok = False
            print(f"  BOUND BROKEN in phase {p.name}")
    print("every refusal a 429 with Retry-After, every bound held" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
