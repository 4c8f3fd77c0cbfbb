"""Fault table: SIGKILL / SIGSTOP each component kind of a supervised service under load.

Real processes on loopback only: `areal inf run --model tiny-parrot --backend sglang:dN
--detach` (the CPU SGLang engine) and `areal agent run --agent examples.agents.echo.EchoAgent
--num-pairs 2 --detach`, each with the watchdog on (the default). For each row the load is 16
client threads, each running RL sessions (`/rl/start_session`, then chats with the session
key, no client retries) for a bounded number of requests; after a short warm-up one component
gets the signal. Per row:

* errors   - client requests that did not answer 200 during the row;
* healthy  - seconds from the signal until every component is `running` again (watchdog
             state, pid identity) and a fresh chat through the gateway succeeds;
* lost     - acknowledged interactions (a 200 chat; its response id) missing from
             `/rl/export_trajectories` of its session afterwards (must be 0);
* restarts - the victim's restart count.

The row "router SIGKILL under load" also has `known_errors`: requests whose route the gateway
already knew (chats of sessions started before, pinned, with a lease) that failed, which must
be 0: the gateway routes them by what it knows while the router is away; only starting a new
session needs the router, and that waits for it (bounded) - and `router_answer_s`: seconds
from the new router process's start (the watchdog's restart) to its first answered `Route`
(a probe calls it every 10 ms from the kill on), which must be under 1 s.

The row "engine killed mid-stream (migration)" runs the same sessions with long streamed
answers (`ignore_eos`, 48 tokens) and SIGKILLs an engine while streams are under way: its
proxy continues each of them on the other replica (token-preserving migration): lost must
be 0 and `mid_stream` (streams that had tokens and no end at the kill: finished normally /
all) whole. Its `errors` are new turns of sessions pinned to the killed engine's proxy,
refused (503) by the gateway while the router sees that proxy unhealthy (its engine fails
the health check) until the watchdog has restarted the engine.

The row "replica drained" runs the same streaming load and then `areal inf deregister
--replica 1 --drain-timeout 2` (a scale-down): no request may fail (errors 0), the streams
under way all finish (moved to replica 0 with their tokens when they outlast the 2 s), lost
0; `healthy` is how long the command took; replica 1's proxy stays (retired), its engine is
stopped. It has no restarts (n/a).

The row "big client pool" has no fault: one aiohttp session with `--pool` (500) connections
sends `--waves` (4) waves of that many chats at once, the shape of an RL trainer driving its
rollouts through one client. errors must be 0: the gateway's per-client connection limit
(`--max-idle-connections-per-client`, 256) answers past it with `Connection: close`, never
by closing a connection a request may be on. `reconnects` is how many connections the pool
opened beyond its first `--pool` (what the limit costs).

After all rows `stop` runs and every recorded process group (and any process with this
AREAL_HOME in its environment) must be gone: the orphan column.

Then the flood rows (flood_rows.py, unless `--skip-floods`): bodies costly to parse (a session's
gradually grown field flooded at 7 MB, 7 MB Messages and Responses bodies) beside ordinary
chats, with the others' latency and `/health`'s during each.

    uv run python benchmarks/fault_table.py [--replicas 2] [--requests 240] [--json out.json]
        [--skip-agent] [--only-migration] [--only-router] [--skip-floods] [--flood-s 15]
        [--only-client-pool] [--pool 500] [--waves 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import flood_rows
import httpx

from areal_cli import supervisor

ROOT = Path(__file__).resolve().parents[1]
PARROT = ROOT / "models" / "tiny-parrot"
MODEL = "tiny-parrot"
KEY = "fault-admin-key"
CONCURRENCY = 16


class Areal:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if k != "AREAL_ADMIN_API_KEY"}
        self.env["AREAL_HOME"] = str(home)
        bindir = str(Path(sys.executable).parent)
        self.env["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env["CUDA_VISIBLE_DEVICES"] = ""

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "areal_cli.main", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=ROOT,
        )

    def state(self, group: str) -> dict[str, Any]:
        return json.loads((self.home / group / "services" / "default.json").read_text())

    def processes(self) -> list[int]:
        return supervisor.processes_with_env(f"AREAL_HOME={self.home}")


def pgid_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    rest = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] != b"Z":
                return True
    return False


class Load:
    """16 threads of RL sessions (inf) or agent sessions (agent), bounded by count and time."""

    def __init__(
        self, url: str, group: str, total: int, deadline: float, stream: bool = False
    ) -> None:
        self.url = url
        self.group = group
        self.total = total
        self.deadline = deadline
        self.stream = stream
        self.mid = 0  # streams that have tokens and no end yet
        self.signal_at = float("inf")  # when the row's signal was sent
        self.spanning: list[bool] = []  # per stream that had tokens at the signal: it finished
        self.sent = 0
        self.errors: list[str] = []
        self.acked: dict[str, list[str]] = {}  # session id -> acknowledged interaction ids
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._worker, daemon=True) for _ in range(CONCURRENCY)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=max(1.0, self.deadline - time.monotonic() + 30))

    def _take(self) -> bool:
        with self.lock:
            if self.sent >= self.total or time.monotonic() > self.deadline:
                return False
            self.sent += 1
            return True

    def _err(self, what: str) -> None:
        with self.lock:
            self.errors.append(what[:200])
        time.sleep(0.5)  # a client pauses after an error (no retry of that request)

    def _worker(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while self._take():
                try:
                    sid, skey = self._session(c)
                except Exception as e:
                    self._err(f"start: {e!r}")
                    continue
                for turn in range(4):
                    if turn and not self._take():
                        return
                    self._chat(c, sid, skey, turn)

    def _session(self, c: httpx.Client) -> tuple[str, str]:
        admin = {"Authorization": f"Bearer {KEY}"}
        if self.group == "inf":
            r = c.post(
                "/rl/start_session", json={"task_id": "fault", "group_size": 1}, headers=admin
            )
            if r.status_code != 201:
                raise RuntimeError(f"{r.status_code} {r.text[:120]}")
            s = r.json()["sessions"][0]
            return s["session_id"], s["session_api_key"]
        r = c.post("/v1/sessions", json={}, headers=admin)
        if r.status_code != 201:
            raise RuntimeError(f"{r.status_code} {r.text[:120]}")
        return r.json()["session_id"], r.json()["session_api_key"]

    def _chat(self, c: httpx.Client, sid: str, skey: str, turn: int) -> None:
        body = {
            "model": MODEL if self.group == "inf" else "agent",
            "messages": [{"role": "user", "content": f"hello number {turn}"}],
            "max_tokens": 4,
        }
        if self.stream:
            self._stream(c, sid, skey, {**body, "max_tokens": 48, "ignore_eos": True})
            return
        try:
            r = c.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {skey}"}
            )
        except Exception as e:
            self._err(f"chat: {e!r}")
            return
        if r.status_code != 200:
            self._err(f"chat {r.status_code}: {r.text[:120]}")
            return
        with self.lock:
            self.acked.setdefault(sid, []).append(r.json().get("id", ""))

    def _stream(self, c: httpx.Client, sid: str, skey: str, body: dict[str, Any]) -> None:
        """A streamed chat: acknowledged once it ends with a finish reason and no error event."""
        rid, finish, error, mid, first = "", None, "", False, float("inf")
        try:
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json={**body, "stream": True},
                headers={"Authorization": f"Bearer {skey}"},
            ) as r:
                if r.status_code != 200:
                    error = f"chat {r.status_code}: {r.read()[:120]!r}"
                for line in r.iter_lines() if not error else ():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"stream error {chunk['error'].get('code')}"
                        continue
                    rid = chunk.get("id", rid)
                    for ch in chunk.get("choices", []):
                        finish = ch.get("finish_reason") or finish
                    content = any((ch.get("delta") or {}).get("content") for ch in chunk["choices"])
                    if not mid and content and not finish:
                        mid, first = True, time.monotonic()
                        with self.lock:
                            self.mid += 1
                    elif mid and finish:
                        mid = False
                        with self.lock:
                            self.mid -= 1
        except Exception as e:
            error = f"chat: {e!r}"
        if mid:
            with self.lock:
                self.mid -= 1
        if first < self.signal_at < time.monotonic():
            with self.lock:
                self.spanning.append(bool(finish and not error))
        if error or not finish:
            self._err(error or "stream ended without a finish reason")
            return
        with self.lock:
            self.acked.setdefault(sid, []).append(rid)


def _export_with_retry(c: httpx.Client, sids: list[str], patience: float = 180.0) -> httpx.Response:
    # On a loaded machine the watchdog may be restarting a component (the gateway among
    # them) when the row ends; a refused connection then is an outage, not a lost row.
    deadline = time.monotonic() + patience
    while True:
        try:
            r = c.post(
                "/rl/export_trajectories",
                json={"session_ids": sids, "style": "individual"},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            if r.status_code < 500 or time.monotonic() > deadline:
                r.raise_for_status()
                return r
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def exported_ids(url: str, sids: list[str]) -> set[str]:
    out: set[str] = set()
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(0, len(sids), 50):
            r = _export_with_retry(c, sids[i : i + 50])
            out.update(str(row.get("interaction_id")) for row in r.json()["rows"])
    return out


def healthy(a: Areal, group: str, url: str) -> bool:
    try:
        s = a.state(group)
    except (OSError, ValueError):
        return False
    for c in s["components"].values():
        sup = (c.get("meta") or {}).get("supervision") or {}
        if sup.get("state", "running") != "running":
            return False
        try:
            with open(f"/proc/{c['pid']}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return False
        if rest[0] in (b"Z", b"T") or int(rest[19]) != c["start_time"]:
            return False
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            if group == "inf":
                r = c.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "ok"}],
                        "max_tokens": 1,
                    },
                    headers={"Authorization": f"Bearer {KEY}"},
                )
            else:
                r = c.post("/v1/sessions", json={}, headers={"Authorization": f"Bearer {KEY}"})
                if r.status_code == 201:
                    r = c.post(
                        "/v1/chat/completions",
                        json={"model": "agent", "messages": [{"role": "user", "content": "ok"}]},
                        headers={"Authorization": f"Bearer {r.json()['session_api_key']}"},
                    )
                    return r.status_code == 200
            return r.status_code == 200
    except httpx.HTTPError:
        return False


ROUTER_ROW = "router SIGKILL under load"


def _since_boot() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _started_since_boot(pid: int) -> float | None:
    """When process `pid` started, in seconds since boot (/proc/<pid>/stat starttime)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(rest[19]) / os.sysconf("SC_CLK_TCK")


class RouterProbe:
    """From the kill on, calls the router's Route every 10 ms: when did it first answer?"""

    def __init__(self, a: Areal, group: str) -> None:
        import grpc

        from areal_proto.router.v1 import router_pb2, router_pb2_grpc
        from areal_runtime.auth import call_metadata

        s = a.state(group)
        secrets = json.loads((a.home / group / "services" / "default.secrets").read_text())
        self.channel = grpc.insecure_channel(
            s["router"]["address"], options=[("grpc.max_reconnect_backoff_ms", 10)]
        )
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.request = router_pb2.RouteRequest(model=MODEL)
        self.metadata = call_metadata(secrets["internal_token"])
        self.answered_at: float | None = None  # seconds since boot
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import grpc

        time.sleep(0.05)  # the kill lands first
        while not self.stop.is_set():
            try:
                r = self.stub.Route(self.request, timeout=0.5, metadata=self.metadata)
                if r.address:
                    self.answered_at = _since_boot()
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.01)

    def result(self, a: Areal, group: str) -> float | None:
        """Seconds from the new router's start to its first answer."""
        self.thread.join(timeout=30)
        self.stop.set()
        self.channel.close()
        pid = a.state(group)["components"]["router"]["pid"]
        started = _started_since_boot(pid)
        if self.answered_at is None or started is None:
            return None
        return round(self.answered_at - started, 2)


def run_row(
    a: Areal,
    group: str,
    victim: str,
    sig: signal.Signals,
    requests: int,
    row_timeout: float,
    scenario: str = "",
    stream: bool = False,
    drain: str = "",
) -> dict[str, Any]:
    """One row: `sig` to `victim`'s process group under load; or, with `drain` (a replica's
    rank), `areal inf deregister --replica <drain>` under load (victim: its data proxy)."""
    s = a.state(group)
    url = s["gateway"]["url"]
    comp = s["components"][victim]
    load = Load(url, group, requests, time.monotonic() + row_timeout, stream=stream)
    load.start()
    time.sleep(2.0)
    if stream:  # the signal lands while streams are under way
        wait = time.monotonic() + 30
        while load.mid < CONCURRENCY // 2 and time.monotonic() < wait:
            time.sleep(0.05)
    probe = RouterProbe(a, group) if scenario == ROUTER_ROW else None
    t0 = time.monotonic()
    load.signal_at = t0
    back = None
    if drain:
        r = a(
            "inf", "deregister", "--model-name", MODEL, "--replica", drain, "--drain-timeout", "2"
        )
        if r.returncode != 0:
            load.errors.append(f"deregister: {r.stderr.strip()[:160]}")
        else:
            print(f"  {r.stdout.strip()}", file=sys.stderr, flush=True)
    else:
        os.killpg(comp["pgid"], sig)
        if probe is not None:
            probe.start()
    while time.monotonic() - t0 < row_timeout:
        time.sleep(0.25)
        if healthy(a, group, url):
            back = time.monotonic() - t0
            break
    if sig == signal.SIGSTOP:
        try:
            os.killpg(comp["pgid"], signal.SIGCONT)  # at the end; the watchdog killed it anyway
        except ProcessLookupError:
            pass
    load.join()
    lost: int | str = "n/a"
    acked = sum(len(v) for v in load.acked.values())
    if group == "inf":
        # The export reads what the service kept, once it is whole again: on a loaded machine
        # the watchdog may still be restarting a component the row's fault took down with it
        # (a gateway probed as hung while the stopped proxy held its calls).
        settle = time.monotonic() + row_timeout
        while time.monotonic() < settle and not healthy(a, group, url):
            time.sleep(0.5)
        ids = exported_ids(url, list(load.acked))
        lost = sum(1 for v in load.acked.values() for i in v if i not in ids)
    restarts: int | str = "n/a"
    if not drain:
        restarts = (
            (a.state(group)["components"][victim].get("meta") or {}).get("supervision") or {}
        ).get("restarts", 0)
    extra: dict[str, Any] = {}
    if probe is not None:
        # A chat is a request whose route the gateway knew; a session start needs the router.
        extra["known_errors"] = sum(1 for e in load.errors if not e.startswith("start"))
        extra["router_answer_s"] = probe.result(a, group)
    return {
        **extra,
        "scenario": scenario or f"{sig.name} {victim}",
        # streams under way at the signal: finished normally / all of them
        "mid_stream": f"{sum(load.spanning)}/{len(load.spanning)}" if stream else "n/a",
        # the killed engine's proxy's decisions (continued = moved to the other replica)
        "migrations": migrations(a, victim.replace("-worker-", "-data-proxy-")) if stream else {},
        "service": group,
        "victim": victim,
        "signal": "deregister --replica" if drain else sig.name,
        "requests": load.sent,
        "acked": acked,
        "errors": len(load.errors),
        "error_samples": sorted(set(e.split(":")[0] for e in load.errors))[:4],
        "healthy_after_s": round(back, 1) if back is not None else None,
        "lost": lost,
        "restarts": restarts,
    }


async def _pool_waves(url: str, pool: int, waves: int) -> tuple[list[Any], int]:
    """`waves` waves of `pool` chats from one aiohttp session of `pool` connections: each
    result (200 or what failed) and how many connections the pool opened."""
    import aiohttp

    opened = 0

    async def counted(*_: Any) -> None:
        nonlocal opened
        opened += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(counted)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    conn = aiohttp.TCPConnector(limit=pool)
    timeout = aiohttp.ClientTimeout(total=600)
    results: list[Any] = []
    async with aiohttp.ClientSession(
        url, connector=conn, timeout=timeout, trace_configs=[trace],
        headers={"Authorization": f"Bearer {KEY}"},
    ) as http:  # fmt: skip

        async def one() -> Any:
            try:
                async with http.post("/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status
            except (TimeoutError, aiohttp.ClientError) as e:
                return type(e).__name__

        for _ in range(waves):
            results += await asyncio.gather(*(one() for _ in range(pool)))
    return results, opened


def client_pool_row(a: Areal, pool: int, waves: int) -> dict[str, Any]:
    """The big-client-pool row (no fault): every request must answer 200."""
    url = a.state("inf")["gateway"]["url"]
    t0 = time.monotonic()
    results, opened = asyncio.run(_pool_waves(url, pool, waves))
    errors = [str(r) for r in results if r != 200]
    return {
        "scenario": f"big client pool ({pool} conns, {waves} waves of {pool})",
        "mid_stream": "n/a",
        "migrations": {},
        "service": "inf",
        "victim": "-",
        "signal": "-",
        "requests": len(results),
        "acked": len(results) - len(errors),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:4],
        "healthy_after_s": None,
        "lost": "n/a",
        "restarts": "n/a",
        "reconnects": max(0, opened - pool),
        "seconds": round(time.monotonic() - t0, 1),
    }


def migrations(a: Areal, proxy: str) -> dict[str, int]:
    """`areal_proxy_migrations_total` of an inf proxy, by outcome (its metrics port)."""
    try:
        info = json.loads((a.home / "inf" / "run" / "default" / f"{proxy}.ready").read_text())
        body = httpx.get(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10).text
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return {}
    out: dict[str, int] = {}
    for line in body.splitlines():
        if line.startswith("areal_proxy_migrations_total{"):
            head, _, value = line.rpartition(" ")
            out[head.split('outcome="', 1)[1].split('"', 1)[0]] = int(float(value))
    return out


def orphans(a: Areal, group: str, pgids: set[int]) -> list[int]:
    r = a(group, "stop", "--grace", "10")
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = [g for g in pgids if pgid_alive(g)]
        if not left:
            break
        time.sleep(0.2)
    return [g for g in pgids if pgid_alive(g)]


def s_url(a: Areal) -> str:
    return str(a.state("inf")["gateway"]["url"])


def all_pgids(a: Areal, group: str) -> set[int]:
    try:
        return {c["pgid"] for c in a.state(group)["components"].values()}
    except (OSError, ValueError):
        return set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--requests", type=int, default=240, help="per row")
    p.add_argument("--row-timeout", type=float, default=150.0)
    p.add_argument("--skip-agent", action="store_true")
    p.add_argument(
        "--only-migration",
        action="store_true",
        help="only the engine-killed-mid-stream and replica-drained rows",
    )
    p.add_argument(
        "--only-router", action="store_true", help=f"only the {ROUTER_ROW!r} row (no agent rows)"
    )
    p.add_argument("--skip-floods", action="store_true", help="no flood_rows.py rows")
    p.add_argument("--flood-s", type=float, default=15.0, help="seconds per flood row")
    p.add_argument("--only-client-pool", action="store_true", help="only the big-client-pool row")
    p.add_argument("--pool", type=int, default=500, help="the big client pool's connections")
    p.add_argument("--waves", type=int, default=4, help="the big client pool's waves")
    p.add_argument("--json", default="")
    a_ = p.parse_args(argv)
    floods: list[dict[str, Any]] = []
    home = Path(tempfile.mkdtemp(prefix="areal-faults-"))
    a = Areal(home)
    rows: list[dict[str, Any]] = []
    orphan_report: dict[str, Any] = {}
    models: list[dict[str, Any]] = []  # what `inf models --json` said once the service was up
    try:
        t = time.monotonic()
        r = a(
            "inf", "run", "--model", MODEL, "--backend", f"sglang:d{a_.replicas}",
            "--model-path", str(PARROT), "--detach", "--port", "0", "--admin-api-key", KEY,
            "--routing-strategy", "least_loaded",
        )  # fmt: skip
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        print(f"inf service up in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
        listed = a("inf", "models", "--json")
        if listed.returncode == 0:
            models = json.loads(listed.stdout)["models"]
        seen = all_pgids(a, "inf")
        if not (a_.only_migration or a_.only_router):
            print("row: big client pool", file=sys.stderr, flush=True)
            rows.append(client_pool_row(a, a_.pool, a_.waves))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        if a_.only_client_pool:
            a_.skip_agent = True
        plan = [
            ("gateway", signal.SIGKILL, ""),
            ("router", signal.SIGKILL, ROUTER_ROW),
            (f"{MODEL}-data-proxy-0", signal.SIGKILL, ""),
            (f"{MODEL}-worker-1", signal.SIGKILL, ""),
            (f"{MODEL}-data-proxy-1", signal.SIGSTOP, ""),
        ]
        if a_.only_router:
            plan = [row for row in plan if row[2] == ROUTER_ROW]
        for victim, sig, scenario in [] if a_.only_migration or a_.only_client_pool else plan:
            print(f"row: {scenario or sig.name + ' ' + victim}", file=sys.stderr, flush=True)
            rows.append(
                run_row(a, "inf", victim, sig, a_.requests, a_.row_timeout, scenario=scenario)
            )
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
            seen |= all_pgids(a, "inf")
        if a_.replicas > 1 and not (a_.only_router or a_.only_client_pool):
            scenario = "engine killed mid-stream (migration)"
            print(f"row: {scenario}", file=sys.stderr, flush=True)
            victim = f"{MODEL}-worker-0"
            rows.append(
                run_row(
                    a, "inf", victim, signal.SIGKILL, a_.requests, a_.row_timeout, scenario, True
                )
            )
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
            seen |= all_pgids(a, "inf")
            # Graceful drain of replica 1 under the same streaming load: what is on its
            # engine after 2 s moves to replica 0, its proxy stays for its sessions.
            scenario = "replica drained"
            print(f"row: {scenario}", file=sys.stderr, flush=True)
            victim = f"{MODEL}-data-proxy-1"
            drained = run_row(
                a, "inf", victim, signal.SIGTERM, a_.requests, a_.row_timeout, scenario,
                stream=True, drain="1",
            )  # fmt: skip
            rows.append(drained)
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        if not (a_.skip_floods or a_.only_migration or a_.only_router or a_.only_client_pool):
            # Costly bodies beside ordinary chats (flood_rows.py): the service is whole again
            # after the signal rows; the rows are printed in a table of their own.
            print("rows: floods of costly bodies", file=sys.stderr, flush=True)
            floods = flood_rows.run_floods(s_url(a), seconds=a_.flood_s)
        orphan_report["inf"] = orphans(a, "inf", seen)
        if not (a_.skip_agent or a_.only_migration or a_.only_router):
            r = a(
                "agent", "run", "--agent", "examples.agents.echo.EchoAgent", "--num-pairs", "2",
                "--admin-api-key", KEY, "--health-poll-interval", "0.5",
            )  # fmt: skip
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
            seen = all_pgids(a, "agent")
            for victim, sig in (("worker-0", signal.SIGKILL),):
                print(f"row: {sig.name} agent {victim}", file=sys.stderr, flush=True)
                rows.append(run_row(a, "agent", victim, sig, a_.requests, a_.row_timeout))
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
                seen |= all_pgids(a, "agent")
            orphan_report["agent"] = orphans(a, "agent", seen)
    finally:
        for group in ("inf", "agent"):
            if (home / group / "services" / "default.json").exists():
                a(group, "stop", "--force")
        leftover = a.processes()
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        orphan_report["processes_with_home"] = leftover
    for row in rows:
        row["migrated"] = row.get("migrations", {}).get("continued", "n/a")
        row["orphans_after_stop"] = len(orphan_report.get(row["service"], [])) + len(
            orphan_report["processes_with_home"]
        )
    print_table(rows)
    if floods:
        flood_rows.print_rows(floods)
    if a_.json:
        Path(a_.json).write_text(
            json.dumps(
                {"rows": rows, "floods": floods, "orphans": orphan_report, "models": models},
                indent=2,
            )
        )
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    head = [
        "scenario",
        "service",
        "victim",
        "signal",
        "requests",
        "acked",
        "errors",
        "healthy_after_s",
        "lost",
        "restarts",
        "reconnects",
        "mid_stream",
        "migrated",
        "orphans_after_stop",
        "known_errors",
        "router_answer_s",
    ]
    table = [[str(r.get(h, "n/a")) for h in head] for r in rows]
    widths = [
        max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(head)
    ]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)) + " |")
    for r in rows:
        if r["error_samples"]:
            print(f"  {r['victim']}: {', '.join(r['error_samples'])}")


if __name__ == "__main__":
    sys.exit(main())
