"""Route leases in the gateway (routing.RouteTable) against a stand-in router object."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_gateway import routing
from areal_gateway.clients.router import RouterUnreachable
from areal_gateway.routing import RouteTable
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import ServiceError

MODEL = router_pb2.ModelInfo(name="m", kind=router_pb2.MODEL_KIND_INTERNAL)


class StubRouter:
    """Answers Route like a router granting leases over `proxies` (id -> load)."""

    def __init__(self, proxies: dict[str, int], lease_ms: int = 60_000, policy: str = "") -> None:
        self.proxies = proxies
        # session -> proxy id: leased like a router leases pins.
        self.pins: dict[str, str] = {}
        self.lease_ms = lease_ms
        self.policy = policy or "round_robin"
        self.epoch = 0
        self.calls: list[dict[str, Any]] = []
        self.delay = 0.0
        self.fail: ServiceError | None = None

    async def route(self, model: str, **kw: Any) -> router_pb2.RouteResponse:
        self.calls.append({"model": model, **kw})
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        session = kw.get("session_id")
        first = self.pins.get(session, "") if session else sorted(self.proxies)[0]
        resp = router_pb2.RouteResponse(proxy_id=first, address=f"addr-{first}", model=MODEL)
        if session:
            if kw.get("want_lease") and first and self.lease_ms:
                resp.lease_ms = self.lease_ms
            return resp
        if kw.get("want_lease") and self.lease_ms:
            resp.lease_ms = self.lease_ms
            resp.lease_policy = self.policy
            for pid in sorted(self.proxies):
                # The router counts its own pick as load before it reports the candidates.
                load = self.proxies[pid] + (pid == first)
                resp.candidates.add(proxy_id=pid, address=f"addr-{pid}", load=load)
        return resp


async def test_lease_round_robin_without_router_calls() -> None:
    router = StubRouter({"a": 0, "b": 0, "c": 0})
    table = RouteTable(router)  # type: ignore[arg-type]
    picks = [(await table.route("m", timeout_s=1)).proxy_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    assert len(router.calls) == 1 and router.calls[0]["want_lease"] is True


async def test_least_loaded_lease_counts_this_gateways_inflight() -> None:
    router = StubRouter({"a": 5, "b": 0}, policy="least_loaded")
    table = RouteTable(router)  # type: ignore[arg-type]
    first = await table.route("m", timeout_s=1)  # the router's own pick
    assert first.proxy_id == "a"
    seen = []
    for _ in range(6):
        p = await table.route("m", timeout_s=1)
        table.acquire(p.address)
        seen.append(p.proxy_id)
    # b takes work until its in-flight count reaches a's reported load, then they alternate.
    assert seen[:5] == ["b"] * 5 and seen[5] in ("a", "b")
    for pid in seen:
        table.release(f"addr-{pid}")
    assert table.inflight == {}


async def test_a_burst_spreads_when_the_routers_view_lags_this_gateways_calls() -> None:
    """The lease is renewed while this gateway has 4 calls on `a` that no report counts yet
    (the router says 0 for both): those 4 still count, so the next 4 requests go to `b`. The
    router's pick for the renewing request is counted once, not twice."""
    router = StubRouter({"a": 0, "b": 0}, policy="least_loaded", lease_ms=60_000)
    table = RouteTable(router)  # type: ignore[arg-type]
    for _ in range(4):
        table.acquire("addr-a")
    first = await table.route("m", timeout_s=1)  # renews: the router picks a (load 0 + 1)
    table.acquire(first.address)
    seen = []
    for _ in range(4):
        p = await table.route("m", timeout_s=1)
        table.acquire(p.address)
        seen.append(p.proxy_id)
    assert seen == ["b"] * 4, seen
    assert table.inflight == {"addr-a": 5, "addr-b": 4}
    nxt = await table.route("m", timeout_s=1)
    assert nxt.proxy_id == "b"  # 5 on a, 4 on b


async def test_a_session_pin_is_reused_for_its_lease_and_only_for_that_model() -> None:
    router = StubRouter({"a": 0, "b": 0}, lease_ms=50)
    router.pins = {"s": "b", "t": "a"}
    table = RouteTable(router)  # type: ignore[arg-type]
    picks = [(await table.route("m", session_id="s", timeout_s=1)).proxy_id for _ in range(3)]
    assert picks == ["b"] * 3
    assert len(router.calls) == 1 and router.calls[0]["want_lease"] is True
    assert (await table.route("m", session_id="t", timeout_s=1)).proxy_id == "a"
    # Another model, the same session: the router decides (it refuses a mismatch).
    await table.route("other", session_id="s", timeout_s=1)
    assert len(router.calls) == 3
    # The session-less lease is separate from the pins.
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 4
    await asyncio.sleep(0.06)  # expired: asked again
    await table.route("m", session_id="s", timeout_s=1)
    assert len(router.calls) == 5
    table.invalidate("m")  # its proxy refused a connection
    await table.route("m", session_id="s", timeout_s=1)
    assert len(router.calls) == 6
    router.epoch += 1  # a registry change through this gateway
    await table.route("m", session_id="s", timeout_s=1)
    assert len(router.calls) == 7


async def test_no_pin_lease_means_one_route_per_session_request() -> None:
    router = StubRouter({"a": 0}, lease_ms=0)
    router.pins = {"s": "a"}
    table = RouteTable(router)  # type: ignore[arg-type]
    for _ in range(3):
        await table.route("m", session_id="s", timeout_s=1)
    assert len(router.calls) == 3


async def test_expired_pins_are_dropped_as_new_ones_come(monkeypatch) -> None:
    # Kept as known routes for KNOWN_ROUTE_S after their lease, then dropped.
    monkeypatch.setattr(routing, "KNOWN_ROUTE_S", 0.05)
    router = StubRouter({"a": 0}, lease_ms=300)
    router.pins = {f"s{i}": "a" for i in range(100)}
    table = RouteTable(router)  # type: ignore[arg-type]
    for i in range(50):
        await table.route("m", session_id=f"s{i}", timeout_s=1)
    assert len(table._pins) == 50
    await asyncio.sleep(0.4)
    await table.route("m", session_id="s99", timeout_s=1)
    assert list(table._pins) == [("m", "s99")]


async def test_expiry_invalidation_and_registry_changes_ask_the_router_again() -> None:
    router = StubRouter({"a": 0, "b": 0}, lease_ms=30)
    table = RouteTable(router)  # type: ignore[arg-type]
    await table.route("m", timeout_s=1)
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 1
    await asyncio.sleep(0.05)
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 2
    router.lease_ms = 60_000
    table.invalidate("m")  # e.g. a proxy refused a connection
    await table.route("m", timeout_s=1)
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 3
    router.epoch += 1  # e.g. a proxy registered through this gateway
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 4


async def test_no_lease_granted_means_one_route_per_request() -> None:
    router = StubRouter({"a": 0}, lease_ms=0)
    table = RouteTable(router)  # type: ignore[arg-type]
    router.delay = 0.01
    await asyncio.gather(*(table.route("m", timeout_s=1) for _ in range(5)))
    # Concurrent requests share the first (lease-asking) call, then route on their own.
    assert len(router.calls) == 5


async def test_concurrent_requests_share_one_renewal_and_its_error() -> None:
    router = StubRouter({"a": 0, "b": 0})
    router.delay = 0.02
    table = RouteTable(router)  # type: ignore[arg-type]
    picks = await asyncio.gather(*(table.route("m", timeout_s=1) for _ in range(10)))
    assert len(router.calls) == 1
    assert {p.proxy_id for p in picks} == {"a", "b"}
    table.invalidate()
    router.fail = ServiceError(404, "no such model", code="model_not_found")
    results = await asyncio.gather(
        *(table.route("m", timeout_s=1) for _ in range(4)), return_exceptions=True
    )
    assert all(isinstance(r, ServiceError) and r.http_status == 404 for r in results)
    assert len(router.calls) == 2


async def test_a_cancelled_first_request_still_installs_the_lease() -> None:
    router = StubRouter({"a": 0, "b": 0})
    router.delay = 0.02
    table = RouteTable(router)  # type: ignore[arg-type]
    task = asyncio.ensure_future(table.route("m", timeout_s=1))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.03)
    await table.route("m", timeout_s=1)
    assert len(router.calls) == 1


# -- while the router cannot be reached -------------------------------------------


async def test_known_routes_serve_while_the_router_is_away(monkeypatch) -> None:
    """Leases and pins ended; the router is unreachable (a restart): a model's last healthy
    proxies and a session's last pin still route, the calls made meanwhile fail fast
    (`patient=False`) instead of waiting for the router; a route nobody knows waits for it
    (`patient=True`) and fails if it does not come back."""
    router = StubRouter({"a": 0, "b": 0}, lease_ms=20, policy="least_loaded")
    router.pins = {"s": "b"}
    table = RouteTable(router)  # type: ignore[arg-type]
    await table.route("m", timeout_s=1)
    assert (await table.route("m", session_id="s", timeout_s=1)).proxy_id == "b"
    await asyncio.sleep(0.03)  # both leases ended
    router.fail = RouterUnreachable("connection refused")
    picks = []
    for _ in range(6):
        p = await table.route("m", timeout_s=1)
        table.acquire(p.address)
        picks.append(p.proxy_id)
    assert sorted(picks) == ["a", "a", "a", "b", "b", "b"]  # still spread by load
    for _ in range(3):
        assert (await table.route("m", session_id="s", timeout_s=1)).proxy_id == "b"
    assert table.known_routes_used == 9
    assert all(c["patient"] is False for c in router.calls[2:]), router.calls
    # A session or model this gateway never routed: only the router knows; wait for it.
    with pytest.raises(RouterUnreachable):
        await table.route("m", session_id="never-seen", timeout_s=1)
    with pytest.raises(RouterUnreachable):
        await table.route("other-model", timeout_s=1)
    assert router.calls[-1]["patient"] is True and router.calls[-2]["patient"] is True
    # The router is back: it decides again, and its answer is the lease.
    router.fail = None
    router.pins = {"s": "a"}
    assert (await table.route("m", session_id="s", timeout_s=1)).proxy_id == "a"


async def test_known_routes_end_with_their_window_a_registry_change_or_a_refusal(
    monkeypatch,
) -> None:
    monkeypatch.setattr(routing, "KNOWN_ROUTE_S", 0.05)
    router = StubRouter({"a": 0}, lease_ms=10)
    router.pins = {"s": "a", "t": "a"}
    table = RouteTable(router)  # type: ignore[arg-type]
    await table.route("m", timeout_s=1)
    await table.route("m", session_id="s", timeout_s=1)
    await table.route("m", session_id="t", timeout_s=1)
    # A refusal of the router's own (the pinned proxy is down) ends the known pin.
    await asyncio.sleep(0.02)
    router.fail = ServiceError(503, "pinned proxy is down", code="session_proxy_unavailable")
    with pytest.raises(ServiceError):
        await table.route("m", session_id="t", timeout_s=1)
    router.fail = RouterUnreachable("connection refused")
    with pytest.raises(RouterUnreachable):
        await table.route("m", session_id="t", timeout_s=1)
    assert (await table.route("m", session_id="s", timeout_s=1)).proxy_id == "a"
    # A registry change made through this gateway: what it knew may be wrong.
    router.epoch += 1
    with pytest.raises(RouterUnreachable):
        await table.route("m", session_id="s", timeout_s=1)
    with pytest.raises(RouterUnreachable):
        await table.route("m", timeout_s=1)
    # Past KNOWN_ROUTE_S nothing is known any more.
    router.fail = None
    await table.route("m", timeout_s=1)
    await asyncio.sleep(0.08)
    router.fail = RouterUnreachable("connection refused")
    with pytest.raises(RouterUnreachable):
        await table.route("m", timeout_s=1)
