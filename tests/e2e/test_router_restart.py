"""A router SIGKILLed under load: requests whose route is known keep flowing, the new router
answers at once.

Real binaries (router, gateway, two data proxies) in front of the real CPU SGLang engine.
16 client threads, each with an RL session started before the kill, send chats with their
session key (a pinned route the gateway holds) and admin chats without a session (the model's
healthy proxies the gateway holds); 4 more threads start new sessions all along (no known
route: they need the router). The router is SIGKILLed and, 1 s later, started again on its
port with its state file, as the watchdog does (`areal_cli.watchdog`).

Asserted: no chat fails; no new session fails either (they wait for the router, bounded);
the new router answers a Route within 1 s of its process starting.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from stack import ADMIN_KEY, launch, start_stack
from testpaths import PARROT

from areal_cli import supervisor
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime.auth import call_metadata

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
SESSIONS = 16
STARTERS = 4
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[float, str, str]] = field(default_factory=list)

    def note(self, kind: str, r: httpx.Response | None, err: str = "") -> None:
        with self.lock:
            if r is not None and r.status_code in (200, 201):
                self.ok[kind] = self.ok.get(kind, 0) + 1
            else:
                what = (
                    err or f"{r.status_code if r is not None else '?'} {r.text[:160] if r else ''}"
                )
                self.failed.append((time.monotonic(), kind, what))


def start_session(c: httpx.Client) -> httpx.Response:
    return c.post("/rl/start_session", json={"task_id": "restart", "group_size": 1}, headers=ADMIN)


def chat(c: httpx.Client, key: str) -> httpx.Response:
    return c.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )


def first_answer(address: str, token: str, since: float, stop: threading.Event) -> float | None:
    """Seconds from `since` until the router at `address` answers a Route with a proxy."""
    with grpc.insecure_channel(address, options=[("grpc.max_reconnect_backoff_ms", 20)]) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        while not stop.is_set():
            try:
                resp = stub.Route(
                    router_pb2.RouteRequest(model=MODEL),
                    timeout=0.5,
                    metadata=call_metadata(token),
                    wait_for_ready=True,
                )
                if resp.address:
                    return time.monotonic() - since
            except grpc.RpcError:
                pass
            time.sleep(0.01)
    return None


def test_router_sigkill_under_load_loses_no_known_route(sglang_engine, tmp_path):
    port = supervisor.free_port()
    router_args = ["--port", str(port), "--state-file", str(tmp_path / "router-state.sqlite")]
    s = start_stack(
        tmp_path / "stack",
        sglang_engine.url,
        PARROT,
        policy="least_loaded",
        router_args=router_args,
    )
    tally = Tally()
    stop = threading.Event()
    try:
        with httpx.Client(base_url=s.gateway_url, timeout=60) as c:
            keys = []
            for _ in range(SESSIONS):
                r = start_session(c)
                assert r.status_code == 201, r.text
                keys.append(r.json()["sessions"][0]["session_api_key"])

        def chats(key: str, kind: str) -> None:
            with httpx.Client(base_url=s.gateway_url, timeout=60) as c:
                while not stop.is_set():
                    try:
                        tally.note(kind, chat(c, key))
                    except httpx.HTTPError as e:
                        tally.note(kind, None, repr(e))

        def starts() -> None:
            with httpx.Client(base_url=s.gateway_url, timeout=60) as c:
                while not stop.is_set():
                    try:
                        tally.note("new session", start_session(c))
                    except httpx.HTTPError as e:
                        tally.note("new session", None, repr(e))
                    time.sleep(0.1)

        threads = [threading.Thread(target=chats, args=(k, "pinned chat")) for k in keys]
        threads += [threading.Thread(target=chats, args=(ADMIN_KEY, "admin chat"))]
        threads += [threading.Thread(target=starts) for _ in range(STARTERS)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        before = dict(tally.ok)
        assert before.get("pinned chat", 0) > 0 and not tally.failed, (before, tally.failed)

        killed_at = time.monotonic()
        os.killpg(s.router.comp.pgid, signal.SIGKILL)
        s.router.popen.wait(10)
        time.sleep(1.0)  # the watchdog's delay (it had a new router in 1.1-1.3 s)
        spawned_at = time.monotonic()
        probe: list[float | None] = []
        prober = threading.Thread(
            target=lambda: probe.append(
                first_answer(f"127.0.0.1:{port}", s.env["AREAL_INTERNAL_TOKEN"], spawned_at, stop)
            )
        )
        prober.start()
        s.router = launch("router", _router_argv(s.router.comp.argv), s.log_dir, s.env)
        prober.join(10)
        time.sleep(3.0)  # load goes on with the new router
        stop.set()
        for t in threads:
            t.join(30)
        outage = time.monotonic() - killed_at
    finally:
        stop.set()
        s.stop()
    after = {k: v - before.get(k, 0) for k, v in tally.ok.items()}
    print(f"\nrouter SIGKILL under load: {outage:.1f} s observed; answered since the kill: {after}")
    span = (
        max(t for t, _, _ in tally.failed) - min(t for t, _, _ in tally.failed)
        if tally.failed
        else 0
    )
    kinds = sorted({(k, w[:60]) for _, k, w in tally.failed})[:6]
    print(f"failed: {len(tally.failed)} over {span:.1f} s {kinds}")
    print(f"new router's first Route answer {probe[0] if probe else None} s after its start")
    assert after.get("pinned chat", 0) > 0 and after.get("admin chat", 0) > 0, after
    assert not [f for f in tally.failed if f[1] != "new session"], tally.failed[:5]
    assert not tally.failed, tally.failed[:5]
    assert probe and probe[0] is not None and probe[0] < 1.0, probe


def _router_argv(argv: list[str]) -> list[str]:
    """The router's recorded argv without its --ready-file (launch adds a new one)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ready-file":
            skip = True
            continue
        out.append(a)
    return out
