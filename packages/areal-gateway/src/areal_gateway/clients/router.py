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
from areal_runtime.errors import (
    ERROR_METADATA_KEY,
    ServiceError,
    UpstreamUnavailable,
    from_rpc_error,
)

log = logging.getLogger(__name__)

# Seconds a call with no other way to go on (a new session's bind, a route nobody knows)
# waits for a router that cannot be reached: the watchdog has a killed router back in about
# a second. Bounded, so a router that is gone for good is still a quick 503.
ROUTER_RESTART_WAIT_S = 5.0

# A restarted router is back at the same address within about a second: the channel tries to
# reconnect at most this often (gRPC's back-off would otherwise grow to seconds, and every
# call would fail fast meanwhile although the router was up again). A connection attempt to
# a closed loopback port costs next to nothing.
_ROUTER_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
)


class RouterUnreachable(UpstreamUnavailable):
    """The router could not be reached (no connection, or it went away during the call): not
    a decision of the router's. The gateway's own finding; routing.RouteTable then uses the
    routes it already knows."""

    def __init__(self, detail: str) -> None:
        # The client is told what happened and what to do; the channel's detail (internal
        # addresses) goes to the log only.
        super().__init__(
            "The gateway cannot reach its router right now (it may be restarting); "
            "retry in a few seconds."
        )
        self.transport_detail = detail


def _has_detail(exc: grpc.RpcError) -> bool:
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in trailing or ())


def router_error(exc: grpc.RpcError, *, waited: bool = False) -> ServiceError:
    """A failed router call as a ServiceError: the router's own refusal as it sent it, a
    transport failure (or, after waiting for the router, its deadline) as RouterUnreachable."""
    if not _has_detail(exc):
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code == grpc.StatusCode.UNAVAILABLE or (
            waited and code == grpc.StatusCode.DEADLINE_EXCEEDED
        ):
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            log.warning("router unreachable: %s", detail)
            return RouterUnreachable(detail or code.name)
    return public(from_rpc_error(exc, target="router"), "router")


class RouterClient:
    """Plain async methods over the router's gRPC API."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self._channel = open_channel(address, _ROUTER_CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._md = call_metadata(token)
        # Bumped by every registry change made through this client: route leases granted
        # before it are void (routing.RouteTable).
        self.epoch = 0

    async def _call(
        self,
        method: Any,
        request: Any,
        timeout_s: float = ROUTER_TIMEOUT,
        *,
        patient: bool = False,
    ) -> Any:
        """One call. A `patient` one that finds the router unreachable waits for it (at most
        ROUTER_RESTART_WAIT_S, within `timeout_s`) and tries once more: a router restart is
        then a delay, not an error. The first try fails fast, so a caller with a route it
        already knows decides for itself (`patient=False`)."""
        metadata = tracing.metadata(self._md)
        try:
            return await method(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            err = router_error(exc)
            if not (patient and isinstance(err, RouterUnreachable)):
                raise err from None
        try:
            return await method(
                request,
                timeout=min(timeout_s, ROUTER_RESTART_WAIT_S),
                metadata=metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise router_error(exc, waited=True) from None

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
        patient: bool = True,
    ) -> router_pb2.RouteResponse:
        """A routing decision. `patient`: wait for a router that is away (see `_call`)."""
        req = router_pb2.RouteRequest(
            model=model,
            session_id=session_id,
            kind=kind,  # type: ignore[arg-type]
            want_lease=want_lease,
            prefix_hashes=prefix_hashes or (),
        )
        return await self._call(self._stub.Route, req, timeout_s, patient=patient)

    async def list_models(self, *, patient: bool = False) -> list[router_pb2.ModelInfo]:
        resp = await self._call(
            self._stub.ListModels, router_pb2.ListModelsRequest(), patient=patient
        )
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
        self,
        session_ids: Sequence[str],
        model: str,
        *,
        kind: int = router_pb2.PROXY_KIND_INFERENCE,
        admit: Sequence[str] | None = None,
        wait_s: float = 0.0,
    ) -> router_pb2.BindSessionResponse:
        """Pin sessions together. With `admit` (the samples among them), the model's
        admission bounds decide first, waiting up to `wait_s` for room (AdmissionRefused:
        429 with retry_after_s)."""
        req = router_pb2.BindSessionRequest(session_ids=list(session_ids), model=model, kind=kind)  # type: ignore[arg-type]
        timeout = ROUTER_TIMEOUT
        if admit is not None:
            req.admission.sample_ids.extend(admit)
            req.admission.wait_s = wait_s
            # The router answers once it admits or refuses: wait_s at most, then a commit.
            timeout += wait_s
        # Patient: binding the same ids again after a lost answer pins them again, and
        # nothing has used those sessions yet.
        return await self._call(self._stub.BindSession, req, timeout, patient=True)

    async def release_sessions(
        self, session_ids: Sequence[str], *, with_bound: bool = False, consumed: bool = False
    ) -> int:
        """Release pins; `with_bound` also releases the sessions bound with a listed group pin
        (ReleaseSessionRequest.with_bound); `consumed`: the admitted sessions among them were
        exported and acknowledged (else they are dropped)."""
        req = router_pb2.ReleaseSessionRequest(
            session_ids=list(session_ids), with_bound=with_bound, consumed=consumed
        )
        resp = await self._call(self._stub.ReleaseSession, req, patient=True)
        return int(resp.released)

    async def end_admitted(self, session_ids: Sequence[str]) -> int:
        """Ended sessions leave the concurrency bound (they keep their staleness place)."""
        req = router_pb2.EndAdmittedRequest(session_ids=list(session_ids))
        resp = await self._call(self._stub.EndAdmitted, req)
        return int(resp.ended)

    async def get_admission(self, model: str = "") -> list[router_pb2.AdmissionState]:
        resp = await self._call(
            self._stub.GetAdmission, router_pb2.GetAdmissionRequest(model=model)
        )
        return list(resp.models)

    async def set_admission(
        self,
        model: str,
        settings: router_pb2.AdmissionSettings | None = None,
        *,
        replace: bool = False,
        reset_consumed: bool = False,
        version: int | None = None,
    ) -> router_pb2.AdmissionState:
        req = router_pb2.SetAdmissionRequest(
            model=model,
            settings=settings or router_pb2.AdmissionSettings(),
            replace=replace,
            reset_consumed=reset_consumed,
        )
        if version is not None:
            req.version = version
        return await self._call(self._stub.SetAdmission, req)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)
