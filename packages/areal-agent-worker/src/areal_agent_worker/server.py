"""Build and run the agent worker: load the agent, serve gRPC, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from areal_agent_worker import __version__
from areal_agent_worker.loader import AgentLoadError, load_agent
from areal_agent_worker.service import AgentWorkerServicer, WorkerMetrics
from areal_agent_worker.settings import Settings
from areal_proto.agent.v1 import agent_worker_pb2_grpc
from areal_runtime import tls
from areal_runtime.auth import server_interceptors
from areal_runtime.ready import write_ready_file

log = logging.getLogger("areal_agent_worker")


@dataclass
class Worker:
    settings: Settings
    server: grpc.aio.Server
    servicer: AgentWorkerServicer
    health: health.aio.HealthServicer
    port: int
    metrics_port: int = -1
    _metrics_http: Any = None

    async def start(self) -> None:
        await self.server.start()
        s = self.settings
        if s.metrics_port >= 0:
            self._metrics_http, _ = start_http_server(
                s.metrics_port, addr=s.host, registry=self.servicer.metrics.prom
            )
            self.metrics_port = self._metrics_http.server_port
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        write_ready_file(
            s.ready_file,
            host=s.host,
            port=self.port,
            version=__version__,
            metrics_port=self.metrics_port,
            agent=s.agent,
        )
        log.info("serving agent %s on %s:%d", s.agent, s.host, self.port)

    async def shutdown(self) -> None:
        """Ordered: refuse new turns, let running ones finish (bounded), run the agent's hook."""
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.settings.drain_timeout)
        hook = getattr(self.servicer.agent, "shutdown", None)
        if hook is not None:
            try:
                await asyncio.wait_for(hook(), timeout=self.settings.drain_timeout)
            except Exception:
                log.exception("agent shutdown hook failed")
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("stopped")


def create_worker(settings: Settings, agent: Any) -> Worker:
    server = grpc.aio.server(interceptors=server_interceptors())
    servicer = AgentWorkerServicer(agent, WorkerMetrics())
    agent_worker_pb2_grpc.add_AgentWorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = tls.bind(server, f"{settings.host}:{settings.port}")
    return Worker(settings, server, servicer, health_servicer, port)


async def serve(settings: Settings) -> int:
    try:
        agent = load_agent(settings.agent)
    except AgentLoadError as e:
        print(f"areal-agent-worker: error: {e}", file=sys.stderr)
        return 2
    try:
        worker = create_worker(settings, agent)
    except tls.TLSConfigError as e:
        print(f"areal-agent-worker: error: {e}", file=sys.stderr)
        return 2
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.shutdown()
    return 0
