"""Health and load at scale: the push stream (grpc.health Watch) and the idle cadence.

Fake proxies here serve `GetStats` and, unless told not to, `grpc.health.v1` as a real
proxy does. The router runs in-process with a health interval long enough that only the
push stream (not a regular poll) can explain a reaction faster than it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router.server import RouterServer, create_server
from areal_router.settings import RouterSettings
from areal_runtime.auth import call_metadata

pytestmark = pytest.mark.timeout(60)

HEALTHY = router_pb2.PROXY_HEALTH_HEALTHY
UNHEALTHY = router_pb2.PROXY_HEALTH_UNHEALTHY
DRAINING = router_pb2.PROXY_HEALTH_DRAINING

# One poll per second while anything happens, one per minute when idle.
SETTINGS = RouterSettings(
    port=0,
    metrics_port=-1,
    health_interval=1.0,
    health_idle_interval=60.0,
    health_timeout=0.5,
    unhealthy_after=2,
    drain_timeout=0.5,
)


@dataclass
class Proxy(proxy_pb2_grpc.ProxyStatusServiceServicer):
    model: str
    with_health: bool = True
    stats: dict = field(default_factory=dict)
    polls: int = 0
    server: grpc.aio.Server | None = None
    health: health.aio.HealthServicer | None = None
    port: int = 0

    async def GetStats(self, request, context):
        self.polls += 1
        return proxy_pb2.ProxyStats(**{"healthy": True, "model": self.model, **self.stats})

    async def start(self, port: int = 0) -> Proxy:
        self.server = grpc.aio.server()
        proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(self, self.server)
        if self.with_health:
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def serving(self, on: bool) -> None:
        assert self.health is not None
        status = health_pb2.HealthCheckResponse
        await self.health.set("", status.SERVING if on else status.NOT_SERVING)

    async def stop(self) -> None:
        """The process dies: its server stops, its connections close."""
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Router:
    server: RouterServer
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterServiceStub
    proxies: list[Proxy] = field(default_factory=list)

    async def add(self, proxy_id: str, *, model: str = "m", with_health: bool = True) -> Proxy:
        proxy = await Proxy(model, with_health).start()
        self.proxies.append(proxy)
        info = router_pb2.ProxyInfo(proxy_id=proxy_id, address=proxy.address, model=model)
        await self.stub.RegisterProxy(
            router_pb2.RegisterProxyRequest(proxy=info), metadata=call_metadata()
        )
        return proxy

    async def route(self, **kw) -> str:
        req = router_pb2.RouteRequest(model="m", **kw)
        return (await self.stub.Route(req, metadata=call_metadata())).proxy_id

    def state(self, proxy_id: str):
        return self.server.registry.proxies[proxy_id]

    def idle(self, proxy_id: str) -> bool:
        return self.server.poller.is_idle(proxy_id)


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    server = create_server(SETTINGS)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    r = Router(server, channel, router_pb2_grpc.RouterServiceStub(channel))
    try:
        yield r
    finally:
        await channel.close()
        await server.shutdown(grace=0)
        for p in r.proxies:
            await p.stop()


async def eventually(pred: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:  # noqa: ASYNC109
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.01)


async def settle_idle(router: Router, *ids: str) -> None:
    """Two polls (one interval apart) that found nothing going on: the idle cadence."""
    await eventually(lambda: all(router.idle(i) for i in ids), timeout=5, what="idle cadence")


async def test_idle_proxies_are_polled_rarely_and_busy_ones_every_interval(router: Router):
    a = await router.add("m-0")
    b = await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    polls_a, polls_b = a.polls, b.polls
    # Work for m-0 only (a session pinned there): it is polled every interval again, so
    # the load it reports reaches the router within an interval; m-1 stays idle.
    bound = await router.stub.BindSession(
        router_pb2.BindSessionRequest(session_ids=["s"], model="m", proxy_id="m-0"),
        metadata=call_metadata(),
    )
    assert bound.proxy_id == "m-0"
    a.stats["inflight_requests"] = 7
    for _ in range(25):
        assert await router.route(session_id="s") == "m-0"
        await asyncio.sleep(0.1)
    assert a.polls - polls_a >= 2, "a proxy being routed to is polled every interval"
    assert b.polls == polls_b, "an idle, unchanged proxy is not polled within its idle interval"
    assert not router.idle("m-0") and router.idle("m-1")
    # The router's load for m-0 is the proxy's report plus what it routed since: fresh.
    assert router.state("m-0").reported_requests == 7
    assert router.state("m-0").load >= 7


async def test_a_lease_wakes_every_candidate(router: Router):
    await router.add("m-0")
    await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    r = await router.stub.Route(
        router_pb2.RouteRequest(model="m", want_lease=True), metadata=call_metadata()
    )
    assert {c.proxy_id for c in r.candidates} == {"m-0", "m-1"}
    # The gateway may now send work to either without asking: neither stays idle.
    assert not router.idle("m-0") and not router.idle("m-1")


async def test_dead_idle_proxy_stops_getting_routes_within_the_interval(router: Router):
    """The guarantee: a proxy whose process dies gets no new request once one
    --health-interval has passed, however long its idle poll interval (60 s here)."""
    dead = await router.add("m-0")
    await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    assert {await router.route() for _ in range(4)} == {"m-0", "m-1"}
    loop = asyncio.get_running_loop()
    await dead.stop()
    t0 = loop.time()
    last_routed = t0
    while loop.time() - t0 < 2 * SETTINGS.health_interval:
        if await router.route() == "m-0":
            last_routed = loop.time()
        await asyncio.sleep(0.005)
    assert last_routed - t0 < SETTINGS.health_interval, (
        f"still routed to the dead proxy {last_routed - t0:.3f}s after it died"
    )
    assert router.state("m-0").health == UNHEALTHY
    assert "connection lost" in router.state("m-0").last_error


async def test_restarted_proxy_is_used_again_without_reregistration(router: Router):
    a = await router.add("m-0")
    await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    port = a.port
    await a.stop()
    await eventually(lambda: router.state("m-0").health == UNHEALTHY, what="unhealthy")
    await a.start(port)
    await eventually(lambda: router.state("m-0").health == HEALTHY, timeout=5, what="back")
    assert "m-0" in {await router.route() for _ in range(4)}


async def test_a_proxy_that_stops_serving_is_unroutable_at_once(router: Router):
    a = await router.add("m-0")
    await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    loop = asyncio.get_running_loop()
    # A drain: the proxy's health service says NOT_SERVING and GetStats says draining.
    a.stats["draining"] = True
    t0 = loop.time()
    await a.serving(False)
    await eventually(lambda: router.state("m-0").health != HEALTHY, what="not routable")
    assert loop.time() - t0 < SETTINGS.health_interval / 2
    # The poll the push triggered tells which: draining.
    await eventually(lambda: router.state("m-0").health == DRAINING, what="draining")
    assert {await router.route() for _ in range(4)} == {"m-1"}
    # Back: SERVING, and a poll that says healthy (never on the push alone).
    a.stats["draining"] = False
    await a.serving(True)
    await eventually(lambda: router.state("m-0").health == HEALTHY, what="healthy again")
    assert loop.time() - t0 < 2 * SETTINGS.health_interval


async def test_an_engine_failure_reported_by_a_poll_is_seen_within_an_interval_when_busy(
    router: Router,
):
    """Without a push (the proxy keeps SERVING), a busy proxy's polls still come every
    interval: an unhealthy report stops its routes within about one interval."""
    a = await router.add("m-0")
    await router.add("m-1")
    await settle_idle(router, "m-0", "m-1")
    loop = asyncio.get_running_loop()
    await router.route()  # work on both: polled every interval from now on
    await router.route()
    a.stats["healthy"] = False
    t0 = loop.time()
    await eventually(lambda: router.state("m-0").health == UNHEALTHY, timeout=3)
    assert loop.time() - t0 <= SETTINGS.health_interval + 0.3


async def test_a_proxy_without_a_health_stream_is_polled_every_interval(router: Router):
    old = await router.add("m-0", with_health=False)
    await asyncio.sleep(2.5 * SETTINGS.health_interval)
    assert old.polls >= 3
    assert not router.idle("m-0")
    # And its death is seen by polls, as before: unhealthy_after failures.
    await old.stop()
    await eventually(lambda: router.state("m-0").health == UNHEALTHY, timeout=4)
