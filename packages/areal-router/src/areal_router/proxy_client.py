"""The only module that talks to data proxies over gRPC (docs/services.md).

Callers get plain values and `ServiceError`, never `grpc.RpcError`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime import tls
from areal_runtime.auth import call_metadata
from areal_runtime.errors import ServiceError, from_rpc_error

log = logging.getLogger("areal_router.proxy_client")


@dataclass(frozen=True)
class ProxyStats:
    healthy: bool
    draining: bool
    inflight_requests: int
    inflight_tokens: int
    sessions: int
    model: str
    detail: str
    # How the proxy reads tool calls and reasoning (shown by ListProxies, `areal inf status`).
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    default_tool_prompt: bool = False
    # The weight version it stamps on new tokens (admission control's version).
    version: int = 0
    # Requests it has taken since it started (the router's load estimate, record_report).
    total_requests: int = 0


class PushUnsupported(Exception):
    """The proxy serves no `grpc.health.v1.Health/Watch`: it can only be polled."""


def _channel_options(reconnect_ms: int) -> list[tuple[str, int]]:
    # A proxy that comes back must be seen within about one poll interval:
    # gRPC's default reconnect backoff grows to 120 s.
    return [
        ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
        ("grpc.min_reconnect_backoff_ms", reconnect_ms),
        ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ("grpc.enable_retries", 0),
    ]


class ProxyClient:
    """One proxy's gRPC channel: its ProxyStatusService and grpc.health.v1, which both
    proxy modes serve."""

    def __init__(self, address: str, *, reconnect_ms: int = 1000) -> None:
        self.address = address
        self._channel = tls.channel(address, options=_channel_options(reconnect_ms))
        self._stub = proxy_pb2_grpc.ProxyStatusServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def watch_serving(self) -> AsyncIterator[bool]:
        """The proxy's serving status (`Health/Watch` of the whole server, ""): now, then at
        each change, for as long as the stream lasts. Raises `PushUnsupported` if the proxy
        has no such stream, `ServiceError` when the stream fails (the proxy went away)."""
        call = self._health.Watch(
            health_pb2.HealthCheckRequest(service=""), metadata=call_metadata()
        )
        try:
            async for r in call:
                yield r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise PushUnsupported(self.address) from None
            raise from_rpc_error(exc, target=f"proxy {self.address}") from None
        finally:
            call.cancel()

    async def get_stats(self, deadline_s: float) -> ProxyStats:
        try:
            r = await self._stub.GetStats(
                proxy_pb2.GetStatsRequest(), timeout=deadline_s, metadata=call_metadata()
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target=f"proxy {self.address}") from None
        return ProxyStats(
            healthy=r.healthy,
            draining=r.draining,
            inflight_requests=r.inflight_requests,
            inflight_tokens=r.inflight_tokens,
            sessions=r.sessions,
            model=r.model,
            detail=r.detail,
            tool_call_parser=r.tool_call_parser,
            reasoning_parser=r.reasoning_parser,
            default_tool_prompt=r.default_tool_prompt,
            version=r.version,
            total_requests=r.total_requests,
        )

    async def close(self) -> None:
        await self._channel.close()


class ProxyClients:
    """Channels to the registered proxies, keyed by proxy id."""

    def __init__(self, *, reconnect_ms: int = 1000) -> None:
        self._reconnect_ms = reconnect_ms
        self._clients: dict[str, ProxyClient] = {}

    async def get(self, proxy_id: str, address: str) -> ProxyClient:
        client = self._clients.get(proxy_id)
        if client is not None and client.address == address:
            return client
        if client is not None:
            await client.close()
        client = self._clients[proxy_id] = ProxyClient(address, reconnect_ms=self._reconnect_ms)
        return client

    async def drop(self, proxy_id: str) -> None:
        client = self._clients.pop(proxy_id, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        for c in clients:
            await c.close()


__all__ = ["ProxyClient", "ProxyClients", "ProxyStats", "PushUnsupported", "ServiceError"]
