"""What one `start_session` pin costs the router's state, by how many sessions are pinned.

    uv run python benchmarks/router_state.py [--sizes 1000,10000,100000] [--binds 100]
        [--concurrency 64] [--no-fsync-count]

For each size N it pins N existing sessions (groups of 8 over 4 proxies), then times what
`BindSession` does for a new group of `/rl/start_session` (a group pin and one session):
`Router.bind` and the state write it waits for before answering. Two designs, same run:

* old: the router before the SQLite store (a copy is below): the whole registry serialized
  to JSON on the event loop, written to a temp file, fsynced, renamed, per change;
* new: `areal_router.store.StateStore` (SQLite, WAL, synchronous=FULL, group commit).

Columns: `bind µs` mean (p99) per bind, one bind at a time (each waits for its write, as an
RPC does); `loop µs` event-loop CPU per bind (time.thread_time of the loop's thread: what
stalls every other RPC); `stall ms` the longest a 1 ms ticker task waited during the binds;
`fsyncs` per bind, counted by strace (fsync + fdatasync) in a child process doing the same
work; then `c=64`: 64 binds at once, wall µs per bind and fsyncs per bind (group commit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_router.policies import Router
from areal_router.registry import HEALTHY, Registry
from areal_router.store import StateStore

GROUP = 8
PROXIES = 4


# -- the old design (areal_router.registry.StateStore before the SQLite store) -----------


def old_write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically with mode 0600 (areal_runtime.ready.write_private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class OldJsonStore:
    """The whole registry to JSON after each change; concurrent flushes share writes."""

    def __init__(self, path: Path, registry: Registry) -> None:
        self.path = path
        self.registry = registry
        self._saved_generation = -1
        self._lock = asyncio.Lock()

    def load(self) -> bool:
        return False

    async def flush(self) -> None:
        async with self._lock:
            if self.registry.generation == self._saved_generation:
                return
            generation = self.registry.generation
            data = json.dumps(self.registry.to_json(), sort_keys=True).encode()
            await asyncio.to_thread(old_write_private, self.path, data)
            self._saved_generation = generation

    async def close(self) -> None:
        await self.flush()


# -- the work --------------------------------------------------------------------------


def make_store(design: str, folder: Path, registry: Registry) -> OldJsonStore | StateStore:
    if design == "old":
        return OldJsonStore(folder / "router-state.json", registry)
    return StateStore(folder / "router-state.db", registry)


async def setup(design: str, folder: Path, n: int) -> tuple[Registry, Router, object]:
    registry = Registry(pin_ttl=86400.0)
    store = make_store(design, folder, registry)
    store.load()
    for i in range(PROXIES):
        p, _ = registry.upsert_proxy(f"m-{i}", f"127.0.0.1:{9000 + i}", "m")
        p.health = HEALTHY
    router = Router(registry, "round_robin")
    for g in range(n // GROUP):
        ids = [f"group:old-{g}", *(f"sess-old-{g}-{j}" for j in range(GROUP - 1))]
        router.bind(ids, "m")
    await store.flush()
    return registry, router, store


def mark(label: str) -> None:
    """A syscall strace shows: where a measured phase starts or ends (see count_fsyncs)."""
    try:
        os.statvfs(f"/__router_state_bench_{label}")
    except OSError:
        pass


async def bind_once(router: Router, store: OldJsonStore | StateStore, tag: str) -> None:
    router.bind([f"group:{tag}", f"sess-{tag}"], "m")
    await store.flush()


async def measure(design: str, n: int, binds: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        registry, router, store = await setup(design, Path(tmp), n)
        assert isinstance(store, OldJsonStore | StateStore)
        times = []
        mark("seq_start")
        cpu0 = time.thread_time()
        for i in range(binds):
            t0 = time.perf_counter()
            await bind_once(router, store, f"new-{i}")
            times.append(time.perf_counter() - t0)
        cpu = time.thread_time() - cpu0
        mark("seq_end")
        # The same binds again beside a 1 ms ticker (a pass of its own: the ticker's own
        # CPU would count as the loop's above).
        stall = 0.0
        stop = False

        async def ticker() -> None:
            nonlocal stall
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                stall = max(stall, now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        stall = 0.0
        for i in range(binds):
            await bind_once(router, store, f"ticked-{i}")
        stop = True
        await tick
        mark("conc_start")
        t0 = time.perf_counter()
        await asyncio.gather(*(bind_once(router, store, f"conc-{i}") for i in range(concurrency)))
        conc = time.perf_counter() - t0
        mark("conc_end")
        await store.close()
        assert len(registry.pins) >= n + 2 * (2 * binds + concurrency) - GROUP
        times.sort()
        return {
            "bind_us": statistics.fmean(times) * 1e6,
            "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6,
            "loop_us": cpu / binds * 1e6,
            "stall_ms": stall * 1e3,
            "conc_us": conc / concurrency * 1e6,
        }


def count_fsyncs(design: str, n: int, binds: int, concurrency: int) -> tuple[float, float] | None:
    """fsync + fdatasync per bind, sequential and concurrent, from strace of a child doing
    the same work; None without strace."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "trace"
        cmd = [strace, "-f", "-qq", "-o", str(log), "-e", "trace=fsync,fdatasync,statfs"]
        cmd += [sys.executable, __file__, "--child", design, str(n), str(binds), str(concurrency)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        counts = {"seq": 0, "conc": 0}
        phase = None
        for line in log.read_text().splitlines():
            m = re.search(r"__router_state_bench_(\w+)_(start|end)", line)
            if m:
                phase = m.group(1) if m.group(2) == "start" else None
            elif phase and re.search(r"\b(fsync|fdatasync)\(", line):
                counts[phase] += 1
    return counts["seq"] / binds, counts["conc"] / concurrency


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--binds", type=int, default=100, help="sequential binds per cell (new)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--no-fsync-count", action="store_true")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        design, n, binds, conc = args.child
        asyncio.run(measure(design, int(n), int(binds), int(conc)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"router state cost per start_session bind (group pin + 1 session), {os.cpu_count()} cpus"
    )
    header = (
        f"{'sessions':>9} {'design':>6} {'binds':>5} {'bind µs (p99)':>20} {'loop µs':>9} "
        f"{'stall ms':>9} {'fsyncs':>7} {'c=64 µs':>9} {'c=64 fsyncs':>12}"
    )
    print(header)
    print("-" * len(header))
    for n in sizes:
        for design in ("old", "new"):
            # The old design at 100k takes ~0.1 s a bind: fewer binds keep the run short.
            binds = args.binds if design == "new" else max(10, min(args.binds, 2_000_000 // n))
            r = asyncio.run(measure(design, n, binds, args.concurrency))
            f = None if args.no_fsync_count else count_fsyncs(design, n, binds, args.concurrency)
            seq_f, conc_f = (f"{f[0]:.2f}", f"{f[1]:.3f}") if f else ("n/a", "n/a")
            bind = f"{r['bind_us']:,.0f} ({r['p99_us']:,.0f})"
            print(
                f"{n:>9,} {design:>6} {binds:>5} {bind:>20} {r['loop_us']:>9,.0f} "
                f"{r['stall_ms']:>9.1f} {seq_f:>7} {r['conc_us']:>9,.0f} {conc_f:>12}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
