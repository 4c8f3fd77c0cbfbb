"""The router over real gRPC on loopback, against fake proxies that answer GetStats."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router.registry import NOT_POLLED
from areal_router.server import RouterServer, create_server
from areal_router.settings import RouterSettings
from areal_router.store import read_state
from areal_runtime.auth import TOKEN_ENV, call_metadata
from areal_runtime.errors import from_rpc_error

pytestmark = pytest.mark.timeout(30)

FAST = RouterSettings(
    port=0,
    metrics_port=-1,
    health_interval=0.05,
    health_timeout=0.5,
    unhealthy_after=2,
    drain_timeout=0.5,
)


# -- fakes and helpers -----------------------------------------------------


@dataclass
class FakeProxy(proxy_pb2_grpc.ProxyStatusServiceServicer):
    """A data proxy of either mode, as the router sees it: GetStats, with whatever the test
    sets."""

    model: str
    stats: dict = field(default_factory=dict)
    polls: int = 0
    # Seconds each GetStats takes.
    delay: float = 0.0
    server: grpc.aio.Server | None = None
    port: int = 0

    async def GetStats(self, request, context):
        self.polls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        s = {"healthy": True, "model": self.model, **self.stats}
        return proxy_pb2.ProxyStats(**s)

    async def start(self, port: int = 0) -> FakeProxy:
        self.server = grpc.aio.server()
        proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def eventually(pred: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:  # noqa: ASYNC109
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


@dataclass
class Harness:
    server: RouterServer
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterServiceStub
    fakes: list[FakeProxy] = field(default_factory=list)

    async def add_proxy(self, proxy_id: str, model: str, **stats) -> FakeProxy:
        fake = await FakeProxy(model, stats).start()
        self.fakes.append(fake)
        await self.stub.RegisterProxy(
            router_pb2.RegisterProxyRequest(
                proxy=router_pb2.ProxyInfo(proxy_id=proxy_id, address=fake.address, model=model)
            ),
            metadata=call_metadata(),
        )
        return fake

    async def route(self, model: str, **kw) -> str:
        r = await self.stub.Route(
            router_pb2.RouteRequest(model=model, **kw), metadata=call_metadata()
        )
        return r.proxy_id

    def proxy(self, proxy_id: str):
        return self.server.registry.proxies[proxy_id]


async def start_router(settings: RouterSettings) -> Harness:
    server = create_server(settings)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    return Harness(server, channel, router_pb2_grpc.RouterServiceStub(channel))


async def stop_router(h: Harness) -> None:
    await h.channel.close()
    await h.server.shutdown(grace=0)
    for fake in h.fakes:
        await fake.stop()


@pytest.fixture
async def router() -> AsyncIterator[Harness]:
    h = await start_router(FAST)
    try:
        yield h
    finally:
        await stop_router(h)


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await coro
    return exc.value


# -- health ----------------------------------------------------------------


async def test_unhealthy_proxy_stops_getting_routes_and_comes_back(router: Harness):
    a = await router.add_proxy("m-0", "m")
    await router.add_proxy("m-1", "m")
    await eventually(lambda: a.polls >= 1, what="first poll")
    assert set(Counter([await router.route("m") for _ in range(4)])) == {"m-0", "m-1"}
    a.stats["healthy"] = False
    a.stats["detail"] = "engine gone"
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY)
    assert {await router.route("m") for _ in range(6)} == {"m-1"}
    listed = await router.stub.ListProxies(router_pb2.ListProxiesRequest(model="m"))
    info = {p.proxy_id: p for p in listed.proxies}
    assert info["m-0"].health == router_pb2.PROXY_HEALTH_UNHEALTHY
    assert info["m-0"].last_error == "engine gone"
    a.stats["healthy"] = True
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_HEALTHY)
    assert "m-0" in {await router.route("m") for _ in range(4)}


async def test_dead_proxy_is_unhealthy_within_the_interval_and_recovers_on_restart(
    router: Harness,
):
    a = await router.add_proxy("m-0", "m")
    await router.add_proxy("m-1", "m")
    await eventually(lambda: a.polls >= 1)
    port = a.port
    await a.stop()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await eventually(
        lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY, timeout=3
    )
    # unhealthy_after=2 polls at 0.05 s: well under a second.
    assert loop.time() - t0 < 1.5
    assert {await router.route("m") for _ in range(6)} == {"m-1"}
    # Same address, new process: used again without re-registration.
    await a.start(port)
    await eventually(
        lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_HEALTHY, timeout=5
    )
    assert "m-0" in {await router.route("m") for _ in range(4)}


async def test_draining_proxy_gets_no_new_work(router: Harness):
    a = await router.add_proxy("m-0", "m")
    await router.add_proxy("m-1", "m")
    a.stats["draining"] = True
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_DRAINING)
    assert {await router.route("m") for _ in range(6)} == {"m-1"}


async def test_proxy_reporting_another_model_is_not_used(router: Harness):
    a = await router.add_proxy("m-0", "m")
    await router.add_proxy("m-1", "m")
    a.stats["model"] = "other"
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY)
    assert "other" in router.proxy("m-0").last_error


async def test_list_proxies_shows_the_parsers_each_proxy_reports(router: Harness):
    """What `areal inf status` shows per replica: the tool-call and reasoning parsers in
    force and whether the proxy writes `tools` into the prompt, as the last poll said."""
    await router.add_proxy("m-0", "m", tool_call_parser="hermes", default_tool_prompt=True)
    await router.add_proxy("m-1", "m", tool_call_parser="qwen25", reasoning_parser="qwen3")

    async def listed() -> dict[str, tuple[str, str, bool]]:
        r = await router.stub.ListProxies(router_pb2.ListProxiesRequest(), metadata=call_metadata())
        return {
            p.proxy_id: (p.tool_call_parser, p.reasoning_parser, p.default_tool_prompt)
            for p in r.proxies
        }

    await eventually(lambda: router.proxy("m-1").health == router_pb2.PROXY_HEALTH_HEALTHY)
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_HEALTHY)
    assert await listed() == {"m-0": ("hermes", "", True), "m-1": ("qwen25", "qwen3", False)}


# -- routing ---------------------------------------------------------------


async def test_least_loaded_follows_reported_load():
    h = await start_router(replace(FAST, policy="least_loaded"))
    try:
        a = await h.add_proxy("m-0", "m", inflight_requests=20)
        b = await h.add_proxy("m-1", "m", inflight_requests=0)
        await eventually(lambda: h.proxy("m-0").reported_requests == 20)
        await eventually(lambda: a.polls >= 1 and b.polls >= 1)
        assert [await h.route("m") for _ in range(3)] == ["m-1"] * 3
        a.stats["inflight_requests"] = 0
        b.stats["inflight_requests"] = 30
        await eventually(lambda: h.proxy("m-1").reported_requests == 30)
        await eventually(lambda: h.proxy("m-0").reported_requests == 0)
        assert [await h.route("m") for _ in range(3)] == ["m-0"] * 3
        listed = await h.stub.ListProxies(router_pb2.ListProxiesRequest())
        loads = {p.proxy_id: p.inflight_requests for p in listed.proxies}
        assert loads["m-1"] >= 30
    finally:
        await stop_router(h)


async def test_route_lease_only_when_asked_and_for_sessions_only_when_pinned():
    h = await start_router(replace(FAST, policy="least_loaded", route_lease=5.0))
    try:
        await h.add_proxy("m-0", "m", inflight_requests=4)
        await h.add_proxy("m-1", "m")
        await eventually(lambda: h.proxy("m-0").reported_requests == 4)

        async def route(**kw) -> router_pb2.RouteResponse:
            return await h.stub.Route(
                router_pb2.RouteRequest(model="m", **kw), metadata=call_metadata()
            )

        assert (await route()).lease_ms == 0
        leased = await route(want_lease=True)
        # Capped at one health-poll interval; the healthy candidates with their load.
        assert leased.lease_ms == int(FAST.health_interval * 1000)
        assert leased.lease_policy == "least_loaded"
        assert {(c.proxy_id, c.load) for c in leased.candidates} >= {("m-0", 4)}
        assert [c.proxy_id for c in leased.candidates] == ["m-0", "m-1"]
        # A session without a pin is placed by the policy, request by request: no lease.
        unpinned = await route(want_lease=True, session_id="s-1")
        assert unpinned.lease_ms == 0 and not unpinned.candidates
        # A pinned session's answer may be reused for a lease (only when asked for).
        await h.stub.BindSession(
            router_pb2.BindSessionRequest(session_ids=["s-2"], model="m", proxy_id="m-1"),
            metadata=call_metadata(),
        )
        pinned = await route(want_lease=True, session_id="s-2")
        assert (pinned.proxy_id, pinned.lease_ms) == ("m-1", int(FAST.health_interval * 1000))
        assert not pinned.candidates
        assert (await route(session_id="s-2")).lease_ms == 0
        # A prefix does not matter to this policy: the lease stands, and the caller is told
        # that prefixes are not wanted.
        with_prefix = await route(want_lease=True, prefix_hashes=[7])
        assert with_prefix.lease_ms > 0 and not with_prefix.wants_prefix
        # cache_aware routes by prefix: no lease, and the caller is asked for prefixes.
        by_prefix = await route(want_lease=True, prefix_hashes=[7], policy="cache_aware")
        assert by_prefix.lease_ms == 0 and by_prefix.wants_prefix
        h.server.service.lease_ms = 0  # --route-lease 0
        assert (await route(want_lease=True)).lease_ms == 0
    finally:
        await stop_router(h)


async def test_errors_are_grpc_statuses_with_detail(router: Harness):
    err = await rpc_error(router.stub.Route(router_pb2.RouteRequest(model="nope")))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert from_rpc_error(err).code == "model_not_found"
    await router.stub.RegisterModel(
        router_pb2.RegisterModelRequest(model=router_pb2.ModelInfo(name="m"))
    )
    err = await rpc_error(router.stub.Route(router_pb2.RouteRequest(model="m")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    a = await router.add_proxy("m-0", "m")
    assert await router.route("m") == "m-0"
    a.stats["healthy"] = False
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY)
    err = await rpc_error(router.stub.Route(router_pb2.RouteRequest(model="m")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert from_rpc_error(err).http_status == 503
    err = await rpc_error(
        router.stub.RegisterModel(
            router_pb2.RegisterModelRequest(model=router_pb2.ModelInfo(name="m"))
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # 409
    err = await rpc_error(
        router.stub.RegisterProxy(
            router_pb2.RegisterProxyRequest(proxy=router_pb2.ProxyInfo(proxy_id="x"))
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_models_are_isolated_and_listed(router: Harness):
    await router.stub.RegisterModel(
        router_pb2.RegisterModelRequest(model=router_pb2.ModelInfo(name="a"))
    )
    await router.stub.RegisterModel(
        router_pb2.RegisterModelRequest(
            model=router_pb2.ModelInfo(
                name="ext",
                kind=router_pb2.MODEL_KIND_EXTERNAL,
                base_url="http://127.0.0.1:9/v1",
                api_key="sk-external-1234",
            )
        )
    )
    await router.add_proxy("a-0", "a")
    await router.add_proxy("b-0", "b")
    await router.add_proxy("b-1", "b")
    assert {await router.route("a") for _ in range(5)} == {"a-0"}
    assert {await router.route("b") for _ in range(5)} == {"b-0", "b-1"}
    ext = await router.stub.Route(router_pb2.RouteRequest(model="ext"))
    assert ext.proxy_id == "" and ext.model.base_url == "http://127.0.0.1:9/v1"
    assert ext.model.api_key == "sk-external-1234" and ext.model.upstream_model == "ext"
    models = {
        m.name: m for m in (await router.stub.ListModels(router_pb2.ListModelsRequest())).models
    }
    assert list(models) == ["a", "b", "ext"]
    assert list(models["b"].proxy_ids) == ["b-0", "b-1"]
    gone = await router.stub.DeregisterModel(router_pb2.DeregisterModelRequest(name="b"))
    assert gone.existed and list(gone.proxy_ids) == ["b-0", "b-1"]
    err = await rpc_error(router.stub.Route(router_pb2.RouteRequest(model="b")))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert router.server.poller.watched == {"a-0"}
    again = await router.stub.DeregisterProxy(router_pb2.DeregisterProxyRequest(proxy_id="b-0"))
    assert not again.existed


async def test_sessions_bind_route_fail_fast_and_release(router: Harness):
    a = await router.add_proxy("m-0", "m", inflight_requests=5)
    await router.add_proxy("m-1", "m")
    await eventually(lambda: router.proxy("m-0").reported_requests == 5)
    bound = await router.stub.BindSession(
        router_pb2.BindSessionRequest(session_ids=["g-0", "g-1"], model="m")
    )
    assert bound.proxy_id == "m-1"  # the less loaded one
    assert {await router.route("m", session_id="g-1") for _ in range(4)} == {"m-1"}
    bound = await router.stub.BindSession(
        router_pb2.BindSessionRequest(session_ids=["h-0"], model="m", proxy_id="m-0")
    )
    assert bound.address == a.address
    listed = await router.stub.ListProxies(router_pb2.ListProxiesRequest(model="m"))
    assert {p.proxy_id: p.sessions for p in listed.proxies} == {"m-0": 1, "m-1": 2}
    # The pinned proxy fails: the session fails fast, naming itself.
    a.stats["healthy"] = False
    await eventually(lambda: router.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY)
    err = await rpc_error(router.stub.Route(router_pb2.RouteRequest(model="m", session_id="h-0")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "h-0" in (err.details() or "")
    # Where the session lives (rewards, exports: no model) is still answered: its records are
    # there, and reading them needs no engine.
    where = await router.stub.Route(router_pb2.RouteRequest(session_id="h-0"))
    assert where.proxy_id == "m-0" and where.address == a.address
    released = await router.stub.ReleaseSession(
        router_pb2.ReleaseSessionRequest(session_ids=["h-0", "g-0", "g-1", "zz"])
    )
    assert released.released == 3
    assert router.server.registry.pins == {}
    assert await router.route("m", session_id="h-0") == "m-1"  # unpinned: routed by policy
    # A group (its pin first, as the gateway binds it) ends with its pin.
    await router.stub.BindSession(
        router_pb2.BindSessionRequest(session_ids=["group:x", "x-0", "x-1"], model="m")
    )
    released = await router.stub.ReleaseSession(
        router_pb2.ReleaseSessionRequest(session_ids=["group:x"], with_bound=True)
    )
    assert released.released == 3 and router.server.registry.pins == {}


async def test_a_pinned_session_asks_its_proxy_again_before_it_is_refused():
    """Found with an unmodified harness: after a cut engine stream on a model's only
    replica, the harness's retry got `session_proxy_unavailable` until the next poll, while the
    engine answered again. The
    retry's Route asks the proxy (which asks its engine); the refusal stays for an engine
    that is really down."""
    # No poll of its own for a minute: only the Route's can see the proxy come back.
    h = await start_router(replace(FAST, health_interval=60.0, health_idle_interval=60.0))
    try:
        a = await h.add_proxy("m-0", "m")
        await eventually(lambda: h.proxy("m-0").health == router_pb2.PROXY_HEALTH_HEALTHY)
        await h.stub.BindSession(router_pb2.BindSessionRequest(session_ids=["s"], model="m"))
        a.stats.update(healthy=False, detail="engine call failed: connection lost")
        await h.server.poller.poll_once("m-0")
        assert h.proxy("m-0").health == router_pb2.PROXY_HEALTH_UNHEALTHY
        # The engine answers again: the retry is routed to it at once.
        a.stats.update(healthy=True, detail="")
        polls = a.polls
        assert await h.route("m", session_id="s") == "m-0"
        assert a.polls == polls + 1
        assert h.proxy("m-0").health == router_pb2.PROXY_HEALTH_HEALTHY
        # Really down: asked, and refused as before, naming the session and why.
        a.stats.update(healthy=False, detail="engine failed its health check")
        await h.server.poller.poll_once("m-0")
        polls = a.polls
        err = await rpc_error(h.stub.Route(router_pb2.RouteRequest(model="m", session_id="s")))
        assert a.polls == polls + 1
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        detail = from_rpc_error(err)
        assert detail.code == "session_proxy_unavailable"
        assert "'s'" in detail.message and "health check" in detail.message
        # Many retries at once share one poll.
        a.delay = 0.2
        polls = a.polls
        errs = await asyncio.gather(
            *(
                rpc_error(h.stub.Route(router_pb2.RouteRequest(model="m", session_id="s")))
                for _ in range(5)
            )
        )
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE for e in errs)
        assert a.polls == polls + 1
    finally:
        await stop_router(h)


async def test_session_affinity_pins_unknown_sessions():
    h = await start_router(replace(FAST, policy="session_affinity"))
    try:
        await h.add_proxy("m-0", "m")
        await h.add_proxy("m-1", "m")
        first = {sid: await h.route("m", session_id=sid) for sid in ("s0", "s1", "s2", "s3")}
        assert Counter(first.values()) == Counter({"m-0": 2, "m-1": 2})
        for sid, pid in first.items():
            assert await h.route("m", session_id=sid) == pid
        assert len(h.server.registry.pins) == 4
        gone = await h.stub.DeregisterProxy(router_pb2.DeregisterProxyRequest(proxy_id="m-0"))
        assert gone.existed
        assert set(h.server.registry.pins.values()) == {"m-1"}
    finally:
        await stop_router(h)


async def test_pins_expire_unless_used_and_the_expiry_is_persisted(tmp_path):
    """Pins of sessions nobody ends (a crashed episode, a session_affinity id) go after
    --pin-ttl without use; a session in use keeps its pin."""
    state = tmp_path / "router-state.db"
    h = await start_router(
        replace(FAST, policy="session_affinity", pin_ttl=1.0, state_file=str(state))
    )
    try:
        await h.add_proxy("m-0", "m")
        await h.stub.BindSession(
            router_pb2.BindSessionRequest(session_ids=["group:g", "busy", "idle"], model="m")
        )
        assert await h.route("m", session_id="affine") == "m-0"  # pinned by the policy
        assert set(read_state(state)["pins"]) == {"group:g", "busy", "idle", "affine"}
        deadline = asyncio.get_running_loop().time() + 1.6
        while asyncio.get_running_loop().time() < deadline:
            assert await h.route("m", session_id="busy") == "m-0"
            await asyncio.sleep(0.1)
        # The group pin lives while one of its sessions is used.
        await eventually(lambda: set(h.server.registry.pins) == {"group:g", "busy"}, timeout=3)
        err = await rpc_error(h.stub.Route(router_pb2.RouteRequest(session_id="idle")))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        await eventually(lambda: set(read_state(state)["pins"]) == {"group:g", "busy"}, timeout=3)
        assert h.server.registry.proxies["m-0"].sessions == {"group:g", "busy"}
    finally:
        await stop_router(h)


# -- token, health service, metrics, state ---------------------------------


async def test_internal_token_is_required_except_for_health(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "test-internal-token-0123456789")
    h = await start_router(FAST)
    try:
        err = await rpc_error(h.stub.ListModels(router_pb2.ListModelsRequest()))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = await rpc_error(
            h.stub.ListModels(
                router_pb2.ListModelsRequest(), metadata=(("x-areal-internal-token", "wrong"),)
            )
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        await h.stub.ListModels(router_pb2.ListModelsRequest(), metadata=call_metadata())
        health = health_pb2_grpc.HealthStub(h.channel)
        r = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        # The router's own polls carry the token to the proxies.
        seen: list[str] = []

        class TokenCheckingProxy(FakeProxy):
            async def GetStats(self, request, context):
                seen.append(dict(context.invocation_metadata()).get("x-areal-internal-token", ""))
                return await super().GetStats(request, context)

        fake = await TokenCheckingProxy("m").start()
        h.fakes.append(fake)
        await h.stub.RegisterProxy(
            router_pb2.RegisterProxyRequest(
                proxy=router_pb2.ProxyInfo(proxy_id="m-0", address=fake.address, model="m")
            ),
            metadata=call_metadata(),
        )
        await eventually(lambda: bool(seen))
        assert seen[0] == "test-internal-token-0123456789"
    finally:
        await stop_router(h)


async def test_health_service_and_shutdown_marks_not_serving(router: Harness):
    health = health_pb2_grpc.HealthStub(router.channel)
    for service in ("", "areal.router.v1.RouterService"):
        r = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    stopping = asyncio.create_task(router.server.shutdown(grace=0.5))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    await stopping


async def test_metrics_endpoint():
    h = await start_router(replace(FAST, metrics_port=0))
    try:
        await h.add_proxy("m-0", "m")
        await h.route("m")
        await rpc_error(h.stub.Route(router_pb2.RouteRequest(model="nope")))
        assert h.server.metrics_port > 0
        url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert (
            'areal_router_route_decisions_total{model="m",policy="round_robin",result="routed"} 1.0'
            in text
        )
        assert 'model="<unregistered>",policy="round_robin",result="not_found"' in text
        assert 'areal_router_proxies{health="healthy",model="m"} 1.0' in text
        assert "areal_router_route_latency_seconds_bucket" in text
    finally:
        await stop_router(h)


async def test_a_bind_is_answered_after_its_commit_and_other_rpcs_run_meanwhile(tmp_path):
    """A slow disk: the bind's answer waits for its commit (a router killed right after the
    answer restarts with the pin), and the commit runs off the event loop, so other RPCs are
    answered while it is under way."""
    import threading
    import time as _time

    state = tmp_path / "router-state.db"
    h = await start_router(replace(FAST, state_file=str(state)))
    try:
        await h.add_proxy("m-0", "m")
        store = h.server.store
        assert store is not None
        real_commit = store._commit
        in_commit, committed = threading.Event(), threading.Event()

        def slow(batch):
            in_commit.set()
            _time.sleep(0.5)
            real_commit(batch)
            committed.set()

        store._commit = slow  # type: ignore[method-assign]
        bind = asyncio.ensure_future(
            h.stub.BindSession(router_pb2.BindSessionRequest(session_ids=["s0"], model="m"))
        )
        await eventually(in_commit.is_set, what="the commit to start")
        listed = await h.stub.ListProxies(router_pb2.ListProxiesRequest())
        assert [p.sessions for p in listed.proxies] == [1]
        assert not committed.is_set()  # answered while the commit was still running
        assert not bind.done()  # and the bind is not answered before it
        await bind
        assert committed.is_set()
        assert read_state(state)["pins"] == {"s0": "m-0"}
    finally:
        await stop_router(h)


async def test_state_file_restores_registrations_and_pins(tmp_path):
    state = tmp_path / "router-state.json"
    settings = replace(FAST, state_file=str(state))
    h = await start_router(settings)
    fakes: list[FakeProxy] = []
    try:
        await h.stub.RegisterModel(
            router_pb2.RegisterModelRequest(
                model=router_pb2.ModelInfo(
                    name="ext",
                    kind=router_pb2.MODEL_KIND_EXTERNAL,
                    base_url="http://u/v1",
                    api_key="sk-k",
                )
            )
        )
        await h.add_proxy("m-0", "m")
        await h.add_proxy("m-1", "m")
        bound = await h.stub.BindSession(
            router_pb2.BindSessionRequest(session_ids=["s0", "s1"], model="m")
        )
        # Acknowledged means on disk: a router killed now restarts with these pins.
        assert read_state(state)["pins"] == {"s0": bound.proxy_id, "s1": bound.proxy_id}
    finally:
        fakes = h.fakes
        await stop_router(h)  # stops the fakes too
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
    saved = read_state(state)
    assert saved["pins"] == {"s0": bound.proxy_id, "s1": bound.proxy_id}

    # The bound proxy lives on (same port); the other one is gone for good.
    by_id = {"m-0": fakes[0], "m-1": fakes[1]}
    await by_id[bound.proxy_id].start(by_id[bound.proxy_id].port)
    other = "m-1" if bound.proxy_id == "m-0" else "m-0"
    h = await start_router(settings)
    h.fakes = fakes
    try:
        models = (await h.stub.ListModels(router_pb2.ListModelsRequest())).models
        assert {m.name: list(m.proxy_ids) for m in models} == {"ext": [], "m": ["m-0", "m-1"]}
        assert next(m for m in models if m.name == "ext").api_key == "sk-k"
        # Polled before the router said SERVING: no waiting needed here.
        health = {
            p.proxy_id: p.health
            for p in (await h.stub.ListProxies(router_pb2.ListProxiesRequest())).proxies
        }
        assert health == {
            bound.proxy_id: router_pb2.PROXY_HEALTH_HEALTHY,
            other: router_pb2.PROXY_HEALTH_UNHEALTHY,
        }
        assert await h.route("m", session_id="s1") == bound.proxy_id
        assert {await h.route("m") for _ in range(3)} == {bound.proxy_id}
        released = await h.stub.ReleaseSession(router_pb2.ReleaseSessionRequest(session_ids=["s0"]))
        assert released.released == 1
    finally:
        await stop_router(h)
    assert read_state(state)["pins"] == {"s1": bound.proxy_id}


async def test_register_proxies_answers_after_every_first_poll_and_names_refused_tokens(
    monkeypatch,
):
    monkeypatch.setenv(TOKEN_ENV, "test-internal-token-0123456789")
    h = await start_router(FAST)
    try:
        good = [await FakeProxy("m").start() for _ in range(3)]
        h.fakes += good

        class RefusingProxy(FakeProxy):
            async def GetStats(self, request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad internal token")

        bad = await RefusingProxy("m").start()
        h.fakes.append(bad)
        infos = [
            router_pb2.ProxyInfo(proxy_id=f"m-{i}", address=f.address, model="m")
            for i, f in enumerate([*good, bad])
        ]
        r = await h.stub.RegisterProxies(
            router_pb2.RegisterProxiesRequest(proxies=infos), metadata=call_metadata()
        )
        # In request order, each as its first poll left it: no caller routes into "not polled".
        assert [p.proxy_id for p in r.proxies] == ["m-0", "m-1", "m-2", "m-3"]
        healthy = router_pb2.PROXY_HEALTH_HEALTHY
        assert [p.health == healthy for p in r.proxies] == [True, True, True, False]
        assert list(r.refused_token) == ["m-3"]
        assert all(f.polls >= 1 for f in good)
        assert {await h.route("m") for _ in range(6)} == {"m-0", "m-1", "m-2"}
        # A bad entry is an error naming its field.
        err = await rpc_error(
            h.stub.RegisterProxies(
                router_pb2.RegisterProxiesRequest(proxies=[router_pb2.ProxyInfo(proxy_id="x")]),
                metadata=call_metadata(),
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await stop_router(h)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_restarted_router_answers_its_first_routes_once_its_proxies_are_polled(tmp_path):
    """A router restarted on its state file listens at once and polls the restored proxies
    meanwhile. A Route or BindSession arriving before those first polls waits for them
    (bounded) and routes, instead of answering no_healthy_proxy for a model whose replicas
    are all up."""
    state = tmp_path / "router-state.sqlite"
    settings = replace(FAST, state_file=str(state))
    h = await start_router(settings)
    fake = await h.add_proxy("m-0", "m")
    await stop_router(h)  # stops the fake too
    await fake.start(fake.port)
    fake.delay = 0.4  # each poll takes a while (within the poll timeout): the first is out below
    port = free_port()
    server = create_server(replace(settings, port=port))
    starting = asyncio.ensure_future(server.start())
    await eventually(lambda: server.port, what="the router binds its port")
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 20)],
    )
    stub = router_pb2_grpc.RouterServiceStub(channel)
    try:
        await channel.channel_ready()
        # Listening, the first poll under way.
        assert not starting.done() and server.registry.proxies["m-0"].last_error == NOT_POLLED
        routed, bound = await asyncio.gather(
            stub.Route(router_pb2.RouteRequest(model="m"), metadata=call_metadata()),
            stub.BindSession(
                router_pb2.BindSessionRequest(session_ids=["s"], model="m"),
                metadata=call_metadata(),
            ),
        )
        assert routed.proxy_id == "m-0" and bound.proxy_id == "m-0"
        await starting
    finally:
        await channel.close()
        await server.shutdown(grace=0)
        await fake.stop()
