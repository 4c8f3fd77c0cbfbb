"""The router's gRPC API as plain async methods."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from areal_gateway.clients.common import (
    ROUTER_TIMEOUT,
    open_channel,
)
from areal_gateway.clients.redact import public
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime import tracing
from areal_runtime.auth import call_metadata
from areal_runtime.errors import from_rpc_error

log = logging.getLogger(__name__)


class RouterClient:
    """Plain async methods over the router's gRPC API."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self._channel = open_channel(address)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._md = call_metadata(token)
        # Bumped by every registry change made through this client: route leases granted
        # before it are void (routing.RouteTable).
        self.epoch = 0

    async def _call(self, method: Any, request: Any, timeout_s: float = ROUTER_TIMEOUT) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=tracing.metadata(self._md))
        except grpc.RpcError as exc:
            raise public(from_rpc_error(exc, target="router"), f"router {self.address}") from None

    async def _change(self, method: Any, request: Any) -> Any:
        """A registry change: leases granted before it ends, or while it runs, are void."""
        self.epoch += 1
        try:
            return await self._call(method, request)
        finally:
            self.epoch += 1

    async def route(
        self,
        model: str,
        *,
        session_id: str = "",
        kind: int = router_pb2.PROXY_KIND_INFERENCE,
        want_lease: bool = False,
        prefix_hashes: list[int] | None = None,
        timeout_s: float = ROUTER_TIMEOUT,
    ) -> router_pb2.RouteResponse:
        req = router_pb2.RouteRequest(
            model=model,
            session_id=session_id,
            kind=kind,  # type: ignore[arg-type]
            want_lease=want_lease,
            prefix_hashes=prefix_hashes or (),
        )
        return await self._call(self._stub.Route, req, timeout_s)

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        resp = await self._call(self._stub.ListModels, router_pb2.ListModelsRequest())
        return list(resp.models)

    async def list_proxies(self, model: str = "", kind: int = 0) -> list[router_pb2.ProxyInfo]:
        req = router_pb2.ListProxiesRequest(model=model, kind=kind)  # type: ignore[arg-type]
        resp = await self._call(self._stub.ListProxies, req)
        return list(resp.proxies)

    async def register_model(self, model: router_pb2.ModelInfo) -> None:
        await self._change(self._stub.RegisterModel, router_pb2.RegisterModelRequest(model=model))

    async def deregister_model(self, name: str) -> tuple[bool, list[str]]:
        resp = await self._change(
            self._stub.DeregisterModel, router_pb2.DeregisterModelRequest(name=name)
        )
        return bool(resp.existed), list(resp.proxy_ids)

    async def register_proxy(self, proxy: router_pb2.ProxyInfo) -> None:
        await self._change(self._stub.RegisterProxy, router_pb2.RegisterProxyRequest(proxy=proxy))

    async def register_proxies(
        self, proxies: list[router_pb2.ProxyInfo], timeout_s: float
    ) -> tuple[list[router_pb2.ProxyInfo], list[str]]:
        """Register many proxies in one call: (each as its first poll found it, the ids of
        those that refused the internal token). A router older than RegisterProxies gets
        them one by one (64 in flight) and reports no refusal."""
        request = router_pb2.RegisterProxiesRequest(proxies=proxies)
        self.epoch += 1
        try:
            resp = await self._stub.RegisterProxies(
                request, timeout=timeout_s, metadata=tracing.metadata(self._md)
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise public(
                    from_rpc_error(exc, target="router"), f"router {self.address}"
                ) from None
            await self._register_one_by_one(proxies)
            return list(proxies), []
        finally:
            self.epoch += 1
        return list(resp.proxies), list(resp.refused_token)

    async def _register_one_by_one(self, proxies: list[router_pb2.ProxyInfo]) -> None:
        """Once every call has ended, raise the first error (a rollback must not race a
        registration still on its way)."""
        slots = asyncio.Semaphore(64)

        async def one(p: router_pb2.ProxyInfo) -> None:
            async with slots:
                await self.register_proxy(p)

        results = await asyncio.gather(*(one(p) for p in proxies), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def deregister_proxy(self, proxy_id: str) -> bool:
        resp = await self._change(
            self._stub.DeregisterProxy, router_pb2.DeregisterProxyRequest(proxy_id=proxy_id)
        )
        return bool(resp.existed)

    async def warm(self, timeout_s: float = 2.0) -> bool:
        """Open the channel now, so the first request does not pay for the connection."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except (TimeoutError, grpc.RpcError):
            return False
        return True

    async def bind_sessions(
        self, session_ids: Sequence[str], model: str, *, kind: int = router_pb2.PROXY_KIND_INFERENCE
    ) -> router_pb2.BindSessionResponse:
        req = router_pb2.BindSessionRequest(session_ids=list(session_ids), model=model, kind=kind)  # type: ignore[arg-type]
        return await self._call(self._stub.BindSession, req)

    async def release_sessions(
        self, session_ids: Sequence[str], *, with_bound: bool = False
    ) -> int:
        """Release pins; `with_bound` also releases the sessions bound with a listed group pin
        (ReleaseSessionRequest.with_bound)."""
        req = router_pb2.ReleaseSessionRequest(session_ids=list(session_ids), with_bound=with_bound)
        resp = await self._call(self._stub.ReleaseSession, req)
        return int(resp.released)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)
