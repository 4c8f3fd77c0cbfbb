"""The agent proxy's server: sessions in front of one agent worker, ordered drain, `serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from areal_agent_proxy import __version__
from areal_agent_proxy.inference_link import InferenceLink
from areal_agent_proxy.metrics import AgentProxyMetrics
from areal_agent_proxy.service import AgentModeServicer, add_to_server
from areal_agent_proxy.sessions import AgentSessions
from areal_agent_proxy.settings import Settings
from areal_agent_proxy.worker_client import WorkerClient
from areal_runtime import tls, tracing
from areal_runtime.auth import server_interceptors
from areal_runtime.ready import write_ready_file

log = logging.getLogger("areal_agent_proxy")

# grpc.health names: "" (the whole server) and each service this mode serves.
_SERVICE_NAMES = ("", "areal.proxy.v1.AgentProxyService", "areal.proxy.v1.ProxyStatusService")


class AgentProxyServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker = WorkerClient(settings.worker_addr)
        self.link = (
            InferenceLink(settings.inf_gateway_url, settings.inf_admin_api_key, settings.inf_model)
            if settings.inf_gateway_url
            else None
        )
        self.metrics = AgentProxyMetrics()
        self.servicer = AgentModeServicer(  # type: ignore[abstract]
            self.worker,
            AgentSessions(settings.session_timeout),
            link=self.link,
            proxy_id=settings.proxy_id,
            turn_timeout=settings.request_timeout,
            metrics=self.metrics,
        )
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(interceptors=server_interceptors())
        add_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.metrics_port = -1
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        s = self.settings
        self.port = tls.bind(self.server, f"{s.host}:{s.port}")
        await self.server.start()
        self.metrics_port = self.metrics.start(s.host, s.metrics_port)
        self.servicer.worker_healthy = await self.worker.healthy()
        self._watch = asyncio.get_running_loop().create_task(self.servicer.watch())
        for name in _SERVICE_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("agent proxy on %s:%d in front of worker %s", s.host, self.port, s.worker_addr)
        return self.port

    async def shutdown(self) -> None:
        """Ordered: refuse new turns, let running turns finish, stop, close clients."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.servicer.running_turns and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.worker.close()
        if self.link is not None:
            await self.link.close()
        self.metrics.stop()
        log.info("stopped")


async def serve(settings: Settings) -> int:
    tracing.setup("areal-agent-proxy")
    server = AgentProxyServer(settings)
    await server.start()
    write_ready_file(
        settings.ready_file,
        host=settings.host,
        port=server.port,
        version=__version__,
        metrics_port=server.metrics_port,
        proxy_id=settings.proxy_id,
        worker_addr=settings.worker_addr,
        mode="agent",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: shutting down")
    await server.shutdown()
    tracing.shutdown()
    return 0
