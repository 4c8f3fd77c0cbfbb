"""Builds and runs the router: gRPC server, health, polls, state, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router import __version__
from areal_router.health import HealthPoller
from areal_router.metrics import RouterMetrics
from areal_router.policies import Router
from areal_router.proxy_client import ProxyClients
from areal_router.registry import Registry
from areal_router.service import RouterService
from areal_router.settings import RouterSettings
from areal_router.store import StateStore
from areal_runtime import tls, tracing
from areal_runtime.auth import server_interceptors
from areal_runtime.ready import write_ready_file

log = logging.getLogger("areal_router")

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def sweep_interval(pin_ttl: float) -> float:
    """Seconds between expiry sweeps: a tenth of the TTL, at most a minute (a sweep costs
    O(pins expired), so running it often costs nothing when nothing expires)."""
    return max(0.05, min(pin_ttl / 10, 60.0))


@dataclass
class RouterServer:
    """A router built by `create_server`; `start()` listens, `shutdown()` stops."""

    settings: RouterSettings
    registry: Registry
    router: Router
    clients: ProxyClients
    poller: HealthPoller
    metrics: RouterMetrics
    store: StateStore | None
    service: RouterService
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    server: grpc.aio.Server | None = None
    port: int = 0
    metrics_port: int = -1
    _metrics_http: Any = None
    _metrics_thread: threading.Thread | None = None
    _sweeper: asyncio.Task[None] | None = None
    _stopped: bool = False

    async def start(self) -> int:
        """Listen, start polling every registered proxy, mark SERVING. Returns the port."""
        s = self.settings
        self.server = grpc.aio.server(interceptors=server_interceptors())
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = tls.bind(self.server, f"{s.host}:{s.port}")
        if not self.port:
            raise OSError(f"cannot listen on {s.host}:{s.port}")
        await self.server.start()
        if s.metrics_port >= 0:
            self._metrics_http, self._metrics_thread = start_http_server(
                s.metrics_port, addr=s.host, registry=self.metrics.prom
            )
            self.metrics_port = self._metrics_http.server_port
        # Proxies restored from --state-file are routable once polled: poll them
        # before saying SERVING (bounded by the poll timeout).
        restored = list(self.registry.proxies)
        for proxy_id in restored:
            self.poller.watch(proxy_id)
        await self.poller.wait_first_poll(restored, s.health_timeout + 0.5)
        if self.registry.pin_ttl:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_loop(sweep_interval(self.registry.pin_ttl)), name="pin-sweep"
            )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "listening on %s:%d (policy %s, metrics %s, %d models, %d proxies, %d pins restored)",
            s.host,
            self.port,
            s.policy,
            self.metrics_port if self.metrics_port >= 0 else "off",
            len(self.registry.models),
            len(self.registry.proxies),
            len(self.registry.pins),
        )
        return self.port

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def sweep(self) -> list[str]:
        """Release expired pins, and commit them with the uses (`Registry.touch`) that no
        RPC waited for. Returns the expired session ids."""
        expired = self.registry.expire()
        if expired:
            log.info(
                "released %d session pin(s) unused for %gs", len(expired), self.registry.pin_ttl
            )
        if self.store is not None and self.store.dirty:
            await self.store.flush()
        return expired

    async def _sweep_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception:
                # A failed commit is retried by the next one (the keys stay dirty).
                log.exception("pin sweep failed")

    async def shutdown(self, grace: float | None = None) -> None:
        """The ordered shutdown steps (SIGTERM, SIGINT, or a test)."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.drain_timeout if grace is None else grace
        # 1. Tell health checkers we are going away.
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        # 2. Stop accepting; let in-flight calls finish within the grace.
        if self.server is not None:
            await self.server.stop(grace)
        # 3. No more polls, no more sweeps.
        await self.poller.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        # 4. Persist the last changes (the state file is kept: it is the point).
        if self.store is not None:
            try:
                await self.store.close()
            except Exception:
                log.exception("state: final write to %s failed", self.store.path)
        # 5. Close the channels to the proxies.
        await self.clients.close()
        # 6. Metrics endpoint.
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.shutdown)
            self._metrics_http.server_close()
            self._metrics_http = None
        log.info("stopped")


def create_server(settings: RouterSettings) -> RouterServer:
    """Build the router (and load --state-file); nothing listens until `start()`."""
    registry = Registry(pin_ttl=settings.pin_ttl)
    store: StateStore | None = None
    if settings.state_file:
        store = StateStore(settings.state_file, registry)
        if store.load():
            log.info("state: loaded %s", settings.state_file)
        # Pins that expired while the router was down never serve (committed with the
        # first change or sweep).
        if expired := registry.expire():
            log.info("state: %d session pin(s) expired while stopped", len(expired))
    router = Router(registry, settings.policy)
    reconnect_ms = max(100, min(1000, int(settings.health_interval * 1000)))
    clients = ProxyClients(reconnect_ms=reconnect_ms)
    metrics = RouterMetrics(registry)
    poller = HealthPoller(
        registry,
        clients,
        interval=settings.health_interval,
        idle_interval=settings.health_idle_interval,
        timeout=settings.health_timeout,
        unhealthy_after=settings.unhealthy_after,
        on_poll=metrics.poll,
    )
    service = RouterService(
        registry,
        router,
        poller,
        metrics,
        store,
        lease_s=min(settings.route_lease, settings.health_interval),
    )
    return RouterServer(
        settings=settings,
        registry=registry,
        router=router,
        clients=clients,
        poller=poller,
        metrics=metrics,
        store=store,
        service=service,
    )


async def serve(settings: RouterSettings) -> int:
    """Run until SIGTERM/SIGINT, then shut down; returns the exit code."""
    tracing.setup("areal-router")
    server = create_server(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        write_ready_file(
            settings.ready_file,
            host=settings.host,
            port=server.port,
            version=__version__,
            metrics_port=server.metrics_port,
            policy=settings.policy,
        )
        await stop.wait()
        log.info("signal received: draining (up to %.1f s)", settings.drain_timeout)
    finally:
        await server.shutdown()
        tracing.shutdown()
    return 0
