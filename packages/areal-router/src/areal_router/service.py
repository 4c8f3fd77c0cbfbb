"""The RouterService servicer: registry RPCs, Route, session pins, listings."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router.health import HealthPoller
from areal_router.metrics import UNREGISTERED_MODEL, RouterMetrics
from areal_router.policies import Router
from areal_router.registry import NOT_POLLED, ModelState, ProxyState, Registry
from areal_router.store import StateStore
from areal_runtime import tracing
from areal_runtime.errors import (
    AdmissionRefused,
    InvalidRequest,
    NoHealthyReplica,
    NotFound,
    ServiceError,
    Unavailable,
    abort,
)
from areal_runtime.logs import mask

log = logging.getLogger("areal_router.service")

T = TypeVar("T")

_KIND_NAMES: dict[int, str] = {
    router_pb2.MODEL_KIND_INTERNAL: "internal",
    router_pb2.MODEL_KIND_EXTERNAL: "external",
}

# The `result` label of a refused decision, by what kind of error refused it.
_RESULTS: tuple[tuple[type[ServiceError], str], ...] = (
    (InvalidRequest, "invalid"),
    (NotFound, "not_found"),
    (Unavailable, "unavailable"),
    (AdmissionRefused, "refused"),
)


def _result(err: ServiceError) -> str:
    return next((label for cls, label in _RESULTS if isinstance(err, cls)), "error")


# Span attributes of the routing decisions (tracing.py): identifiers are attributes, never
# metric labels. A group is pinned as `group:<id>` beside its sessions (the gateway's rl.py).
_GROUP_PIN = "group:"


def _route_attrs(r: router_pb2.RouteRequest) -> dict[str, object]:
    return {"model": r.model, "session_id": r.session_id, "policy": r.policy}


def _routed_attrs(r: router_pb2.RouteResponse) -> dict[str, object]:
    return {"proxy_id": r.proxy_id, "lease_ms": r.lease_ms, "candidates": len(r.candidates)}


def _bind_attrs(r: router_pb2.BindSessionRequest) -> dict[str, object]:
    groups = [s[len(_GROUP_PIN) :] for s in r.session_ids if s.startswith(_GROUP_PIN)]
    sessions = [s for s in r.session_ids if not s.startswith(_GROUP_PIN)]
    return {
        "model": r.model,
        "group_id": groups[0] if groups else None,
        "session_ids": sessions or None,
    }


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        registry: Registry,
        router: Router,
        poller: HealthPoller,
        metrics: RouterMetrics,
        store: StateStore | None = None,
        *,
        lease_s: float = 0.0,
    ) -> None:
        self.registry = registry
        # Route leases (RouteRequest.want_lease): how long a caller may route on its own.
        self.lease_ms = max(0, int(lease_s * 1000))
        self.router = router
        self.poller = poller
        self.metrics = metrics
        self.store = store

    async def _changed(self) -> None:
        """A registration or pin changed: it is on disk before the caller hears of it, so a
        router killed right after answering restarts knowing what it acknowledged (a session
        it pinned, then forgot, would be exported as unknown). Only the rows changed are
        written, off the event loop, and concurrent changes share one commit (group commit:
        StateStore.flush)."""
        if self.store is not None:
            await self.store.flush()

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ServiceError as err:
            await abort(context, err)
            raise  # abort raises; this line is for the type checker

    # -- proxies --------------------------------------------------------

    async def RegisterProxy(
        self, request: router_pb2.RegisterProxyRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterProxyResponse:
        p = request.proxy

        def do() -> bool:
            state, moved = self.registry.upsert_proxy(
                p.proxy_id, p.address, p.model, p.kind, dict(p.labels)
            )
            if moved:
                self.router.forget_proxies([state.proxy_id])
                self.poller.watch(state.proxy_id)
            log.info("registered proxy %s at %s for model %s", p.proxy_id, p.address, p.model)
            return moved

        moved = await self._call(context, do)
        await self._changed()
        if moved:
            # A proxy is routable once a poll says so: answer after that first poll
            # (bounded), so a caller that registers and then routes finds it ready.
            await self.poller.wait_first_poll([p.proxy_id], self.poller.timeout + 0.5)
        return router_pb2.RegisterProxyResponse()

    async def RegisterProxies(
        self, request: router_pb2.RegisterProxiesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterProxiesResponse:
        """A model's replicas at once: one commit for all, their first polls in parallel
        (1,000 one by one, 64 in flight, took 2.3 s; benchmarks/scale_sim.py). A bad entry
        fails the call; those before it stay registered (the caller rolls its model back)."""

        def do() -> list[str]:
            moved: list[str] = []
            for p in request.proxies:
                state, changed = self.registry.upsert_proxy(
                    p.proxy_id, p.address, p.model, p.kind, dict(p.labels)
                )
                if changed:
                    moved.append(state.proxy_id)
            if moved:
                self.router.forget_proxies(moved)
                for proxy_id in moved:
                    self.poller.watch(proxy_id)
            models = sorted({p.model for p in request.proxies})
            log.info("registered %d proxies for %s", len(request.proxies), ", ".join(models))
            return moved

        moved = await self._call(context, do)
        await self._changed()
        if moved:
            await self.poller.wait_first_poll(moved, self.poller.timeout + 0.5)
        proxies = self.registry.proxies
        return router_pb2.RegisterProxiesResponse(
            proxies=[
                proxies[p.proxy_id].to_proto() for p in request.proxies if p.proxy_id in proxies
            ],
            refused_token=[pid for pid in moved if self.poller.refused_token(pid)],
        )

    async def DeregisterProxy(
        self, request: router_pb2.DeregisterProxyRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterProxyResponse:
        existed = self.registry.remove_proxy(request.proxy_id)
        if existed:
            self.poller.unwatch(request.proxy_id)
            self.router.forget_proxies([request.proxy_id])
            await self._changed()
            log.info("deregistered proxy %s", request.proxy_id)
        return router_pb2.DeregisterProxyResponse(existed=existed)

    # -- models ---------------------------------------------------------

    async def RegisterModel(
        self, request: router_pb2.RegisterModelRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterModelResponse:
        m = request.model

        def do() -> None:
            self.registry.add_model(
                ModelState(
                    name=m.name,
                    kind=m.kind,
                    base_url=m.base_url,
                    api_key=m.api_key,
                    upstream_model=m.upstream_model,
                    created_unix_s=m.created_unix_s,
                )
            )
            log.info(
                "registered model %s (%s%s)",
                m.name,
                _KIND_NAMES.get(self.registry.models[m.name].kind, "?"),
                f", {m.base_url}, key {mask(m.api_key)}" if m.base_url else "",
            )

        await self._call(context, do)
        await self._changed()
        return router_pb2.RegisterModelResponse()

    async def DeregisterModel(
        self, request: router_pb2.DeregisterModelRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterModelResponse:
        existed, proxy_ids = self.registry.remove_model(request.name)
        if existed:
            for pid in proxy_ids:
                self.poller.unwatch(pid)
            self.router.forget_proxies(proxy_ids)
            self.router.forget_model(request.name)
            await self._changed()
            log.info("deregistered model %s and proxies %s", request.name, proxy_ids)
        return router_pb2.DeregisterModelResponse(existed=existed, proxy_ids=proxy_ids)

    # -- routing --------------------------------------------------------

    async def _first_polled(self, model: str, kind: int, decide: Callable[[], T]) -> T:
        """`decide()`; when it finds no healthy proxy while some of the model's proxies have
        never been polled (a router just restarted: restored proxies are routable once a
        poll says so, and the polls start with the server), wait for their first poll
        (bounded) and decide again. Without this a restarted router answered its first
        requests `no_healthy_proxy` although every replica was up. Costs nothing otherwise."""
        try:
            return decide()
        except NoHealthyReplica:
            unpolled = [
                p.proxy_id
                for p in self.registry.proxies_of(model)
                if p.last_error == NOT_POLLED and (not kind or p.kind == kind)
            ]
            if not unpolled:
                raise
        await self.poller.wait_first_poll(unpolled, self.poller.timeout + 0.5)
        return decide()

    @tracing.rpc("router.Route", _route_attrs, _routed_attrs)
    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        start = time.perf_counter()
        policy = request.policy or self.router.default_policy
        if policy not in self.router.policies:
            policy = "<invalid>"  # a label value per bad request would grow without bound
        model_label = request.model if request.model in self.registry.models else UNREGISTERED_MODEL
        if request.model and request.session_id:
            ask = self.router.pin_to_ask(request.session_id)
            if ask:
                # Its engine may be back: the answer decides, not the last poll's.
                await self.poller.recheck(ask)
        try:
            decision = await self._first_polled(
                request.model,
                request.kind,
                lambda: self.router.route(
                    request.model,
                    session_id=request.session_id,
                    prefix_hashes=request.prefix_hashes,
                    kind=request.kind,
                    policy=request.policy,
                ),
            )
        except ServiceError as err:
            self.metrics.route_latency.observe(time.perf_counter() - start)
            result = _result(err)
            self.metrics.decisions.labels(policy, model_label, result).inc()
            await abort(context, err)
            raise
        proxy = decision.proxy
        if proxy is not None:
            # Its load matters now: if it was on the idle cadence, poll it within an interval.
            self.poller.nudge(proxy.proxy_id)
        if decision.pinned:
            await self._changed()
        response = router_pb2.RouteResponse(
            proxy_id=proxy.proxy_id if proxy else "",
            address=proxy.address if proxy else "",
            model=decision.model.to_proto(with_proxies=False),
        )
        response.wants_prefix = decision.policy == "cache_aware"
        if proxy is not None and not response.wants_prefix and request.want_lease and self.lease_ms:
            if request.session_id:
                # A pin does not move while its proxy stays up, so the caller may reuse this
                # answer for the session for as long as any lease lasts (no candidates). A
                # session without a pin is routed by the policy: no lease.
                if self.registry.pins.get(request.session_id) == proxy.proxy_id:
                    response.lease_ms = self.lease_ms
                    self.metrics.leases.labels(decision.model.name).inc()
            else:
                self._grant_lease(response, decision.model.name, request.kind, decision.policy)
        self.metrics.route_latency.observe(time.perf_counter() - start)
        self.metrics.decisions.labels(
            decision.policy, model_label, "routed" if proxy else "external"
        ).inc()
        return response

    def _grant_lease(
        self, response: router_pb2.RouteResponse, model: str, kind: int, policy: str
    ) -> None:
        """A route lease: no pin and no prompt prefix takes part in this decision, so for a
        short while the caller may spread such requests over the same healthy proxies itself.
        The router stays the source of truth: a lease is never longer than one health poll
        interval, and the caller asks again when it expires or a proxy refuses a call."""
        response.lease_ms = self.lease_ms
        response.lease_policy = "round_robin" if policy == "round_robin" else "least_loaded"
        for p in self.registry.candidates(model, kind):
            response.candidates.add(proxy_id=p.proxy_id, address=p.address, load=max(0, p.load))
            # The caller may send work to any of them until the lease ends.
            self.poller.nudge(p.proxy_id)
        self.metrics.leases.labels(model).inc()

    @tracing.rpc("router.BindSession", _bind_attrs, lambda r: {"proxy_id": r.proxy_id})
    async def BindSession(
        self, request: router_pb2.BindSessionRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.BindSessionResponse:
        admit = request.HasField("admission")
        samples = list(request.admission.sample_ids) if admit else []
        try:
            if admit:
                await self._admit(request, samples)

            def decide() -> ProxyState:
                # The admission check and the reserve below are one step (no await between);
                # after a wait for a restarted router's first polls the room is checked again.
                if admit:
                    refusal = self.registry.admission.try_admit(request.model, len(samples))
                    if refusal is not None:
                        raise refusal
                return self.router.bind(
                    request.session_ids, request.model, kind=request.kind, proxy_id=request.proxy_id
                )

            proxy = await self._first_polled(request.model, request.kind, decide)
            if admit:
                self.registry.admission.admitted(request.model, samples)
                self.metrics.admissions.labels(request.model, "admitted").inc(len(samples))
        except ServiceError as err:
            self.metrics.binds.labels(_result(err)).inc()
            await abort(context, err)
            raise
        self.metrics.binds.labels("bound").inc()
        self.poller.nudge(proxy.proxy_id)
        await self._changed()
        log.debug("pinned %d sessions to %s", len(request.session_ids), proxy.proxy_id)
        return router_pb2.BindSessionResponse(proxy_id=proxy.proxy_id, address=proxy.address)

    async def _admit(self, request: router_pb2.BindSessionRequest, samples: list[str]) -> None:
        """Wait (up to the request's wait_s) until the model has room for `samples`; raise
        the refusal otherwise. The caller reserves them before its next await."""
        model = request.model
        if not model:
            raise InvalidRequest("admission needs the model", param="model")
        stray = set(samples) - set(request.session_ids)
        if stray:
            raise InvalidRequest(
                "admission.sample_ids must be among session_ids", param="admission.sample_ids"
            )
        adm = self.registry.admission
        too_large = adm.impossible(model, len(samples))
        if too_large is not None:
            raise too_large
        try:
            await adm.wait_for_room(model, len(samples), request.admission.wait_s)
        except AdmissionRefused as err:
            adm.refused(model)
            self.metrics.admissions.labels(model, err.code or "refused").inc(len(samples))
            raise

    async def GetAdmission(
        self, request: router_pb2.GetAdmissionRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetAdmissionResponse:
        names = (
            [request.model]
            if request.model
            else sorted(
                m.name
                for m in self.registry.models.values()
                if m.kind != router_pb2.MODEL_KIND_EXTERNAL
            )
        )
        return router_pb2.GetAdmissionResponse(
            models=[self.registry.admission.state(n) for n in names]
        )

    async def SetAdmission(
        self, request: router_pb2.SetAdmissionRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AdmissionState:
        def do() -> None:
            if request.model not in self.registry.models:
                raise NotFound(f"model {request.model!r} is not registered", code="model_not_found")
            self.registry.admission.configure(
                request.model,
                request.settings,
                replace=request.replace,
                reset_consumed=request.reset_consumed,
            )
            if request.HasField("version"):
                self.registry.admission.set_version(request.model, request.version)

        await self._call(context, do)
        await self._changed()
        return self.registry.admission.state(request.model)

    async def EndAdmitted(
        self, request: router_pb2.EndAdmittedRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.EndAdmittedResponse:
        ended = self.registry.admission.end(request.session_ids)
        if ended:
            await self._changed()
        return router_pb2.EndAdmittedResponse(ended=ended)

    async def ReleaseSession(
        self, request: router_pb2.ReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReleaseSessionResponse:
        released = self.router.release(
            request.session_ids, with_bound=request.with_bound, consumed=request.consumed
        )
        if released:
            await self._changed()
        return router_pb2.ReleaseSessionResponse(released=released)

    # -- listings -------------------------------------------------------

    async def ListProxies(
        self, request: router_pb2.ListProxiesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListProxiesResponse:
        out = [
            p.to_proto()
            for p in self.registry.proxies.values()
            if (not request.model or p.model == request.model)
            and (not request.kind or p.kind == request.kind)
        ]
        return router_pb2.ListProxiesResponse(proxies=out)

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            models=[
                m.to_proto() for m in sorted(self.registry.models.values(), key=lambda m: m.name)
            ]
        )
