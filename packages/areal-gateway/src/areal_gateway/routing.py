"""Where a generation request goes: the router decides, possibly through a route lease.

Calling the router's Route for every request costs a gRPC round trip (and the router's CPU)
per request, although a request without a session and without a prompt prefix gets a
decision that depends only on the model's healthy proxies and their load. So the gateway asks
for a *route lease* (RouteRequest.want_lease): the router may answer with the healthy
candidates and a lease of at most one health-poll interval, during which the gateway spreads
such requests over them itself, round robin or least loaded (the router's reported load at
grant time plus this gateway's in-flight calls since), as the router's policy says.

A session's requests all go to its pinned proxy, which does not change while that proxy is
up; so the router leases the pin too (no candidates), and the session's next requests within
the lease skip Route. Without it, a Route call per request was most of what recording a
session cost (benchmarks/recording.py).

The router stays the source of truth:
  * all requests call Route when the router grants no lease (an older router, or
    `--route-lease 0`), and prompt-prefix routing (cache_aware) never gets one;
  * a lease or pin ends when it expires, when a proxy refuses a connection (the retry asks
    the router again), and when this gateway changes the registry (model or proxy
    registration);
  * one Route call renews an expired lease; requests arriving meanwhile wait for that call
    instead of each making their own.

While the router cannot be reached (a restart: the watchdog has it back in about a second),
a route this gateway already knows keeps serving: a session's last pin, a model's last lease
(its healthy proxies then), for up to KNOWN_ROUTE_S after it ended. Nothing can move a pin or
change the registry while the router is away, and a proxy that has gone since refuses the
connection, which ends the known route like any lease. Only a request with no known route
waits for the router (bounded: clients/router.py, ROUTER_RESTART_WAIT_S). A router that
answers, even with a refusal, is always the one that decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from areal_gateway.clients import RouterClient
from areal_gateway.clients.router import RouterUnreachable
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import ServiceError

log = logging.getLogger(__name__)

# Seconds after its lease ended that a route (a pin, a model's healthy proxies) still serves
# while the router cannot be reached. Longer than a router restart by far; short enough that
# an expired pin does not stay in memory for long.
KNOWN_ROUTE_S = 30.0


@dataclass(frozen=True, slots=True)
class Pick:
    """One routing decision: the proxy to call (empty address: no proxy) and the model."""

    proxy_id: str
    address: str
    model: router_pb2.ModelInfo


class _Lease:
    __slots__ = ("base", "epoch", "expires", "model", "next", "picks", "round_robin")

    def __init__(self, resp: router_pb2.RouteResponse, epoch: int, inflight: dict[str, int]):
        self.expires = time.monotonic() + resp.lease_ms / 1000.0
        self.epoch = epoch
        self.model = resp.model
        self.picks = [Pick(c.proxy_id, c.address, resp.model) for c in resp.candidates]
        # Load estimate = router's load at grant + this gateway's in-flight change since.
        # The router's load already counts its own pick for the request that renewed the
        # lease, which that request acquires after this (so it is not counted twice). A
        # router whose view lags this gateway's calls (routed, not yet in a proxy's report)
        # gives a negative base: clamped, so those calls still count as load here; else a
        # busy proxy looked idle and drew a burst.
        self.base = [
            max(0, c.load - inflight.get(c.address, 0) - (c.proxy_id == resp.proxy_id))
            for c in resp.candidates
        ]
        self.round_robin = resp.lease_policy == "round_robin"
        # The router's own pick served the request that got the lease: rotate past it.
        ids = [c.proxy_id for c in resp.candidates]
        self.next = ids.index(resp.proxy_id) + 1 if resp.proxy_id in ids else 0

    def pick(self, inflight: dict[str, int]) -> Pick:
        picks = self.picks
        n = len(picks)
        start = self.next
        self.next = start + 1
        if self.round_robin or n == 1:
            return picks[start % n]
        best, best_load = 0, 0
        for k in range(n):
            i = (start + k) % n
            load = self.base[i] + inflight.get(picks[i].address, 0)
            if k == 0 or load < best_load:
                best, best_load = i, load
        return picks[best]


class RouteTable:
    """Route decisions for one gateway, with route leases per (model, kind)."""

    def __init__(self, router: RouterClient) -> None:
        self._router = router
        # The last lease per (model, kind), kept past its expiry as the known route for
        # while the router is away (see `_known`).
        self._leases: dict[tuple[str, int], _Lease] = {}
        self._renewing: dict[tuple[str, int], asyncio.Future[router_pb2.RouteResponse]] = {}
        # This gateway's calls in progress, by proxy address (least-loaded picks).
        self.inflight: dict[str, int] = {}
        # Models whose router policy routes by prompt prefix (cache_aware), as last told.
        self._by_prefix: set[str] = set()
        # (model, session) -> (pick, expiry, epoch). Every pin lease is as long as the
        # router's lease, so insertion order is expiry order: pins leave from the front
        # KNOWN_ROUTE_S after they expired, and a gateway serving many short sessions does
        # not keep them all.
        self._pins: dict[tuple[str, str], tuple[Pick, float, int]] = {}
        # Requests routed by a known route because the router could not be reached.
        self.known_routes_used = 0
        self._router_away = False

    async def route(
        self,
        model: str,
        *,
        session_id: str = "",
        kind: int = router_pb2.PROXY_KIND_INFERENCE,
        timeout_s: float,
        prefix: Callable[[], list[int]] | None = None,
    ) -> Pick:
        if session_id:
            return await self._session_route(model, session_id, timeout_s)
        if model in self._by_prefix and prefix is not None:
            # cache_aware: every decision depends on the prompt, so no lease; the
            # hashes are computed only for models routed this way.
            resp = await self._router.route(
                model, kind=kind, prefix_hashes=prefix(), timeout_s=timeout_s
            )
            if not resp.wants_prefix:
                self._by_prefix.discard(model)
            return _pick(resp)
        key = (model, kind)
        lease = self._leases.get(key)
        if lease is not None:
            if lease.expires > time.monotonic() and lease.epoch == self._router.epoch:
                return lease.pick(self.inflight)
            if lease.epoch != self._router.epoch:
                del self._leases[key]
        pending = self._renewing.get(key)
        if pending is not None:
            try:
                resp = await asyncio.shield(pending)
            except RouterUnreachable:
                known = self._known(key)
                if known is None:
                    raise
                return self._use_known(known.pick(self.inflight))
            lease = self._leases.get(key)
            if resp.lease_ms and lease is not None:
                return lease.pick(self.inflight)
            # No lease came of it: this request needs its own decision.
            hashes = prefix() if prefix is not None else None
            return _pick(
                await self._router.route(
                    model, kind=kind, prefix_hashes=hashes, timeout_s=timeout_s
                )
            )
        return await self._renew(key, timeout_s, prefix)

    def _known(self, key: tuple[str, int]) -> _Lease | None:
        """The model's last lease, if it may still stand in for the router."""
        lease = self._leases.get(key)
        if lease is None or lease.epoch != self._router.epoch:
            return None
        if lease.expires + KNOWN_ROUTE_S <= time.monotonic():
            return None
        return lease

    def _use_known(self, pick: Pick) -> Pick:
        self.known_routes_used += 1
        if not self._router_away:
            self._router_away = True
            log.warning("router unreachable: routing by the routes this gateway knows")
        return pick

    def _router_back(self) -> None:
        if self._router_away:
            self._router_away = False
            log.info(
                "router reachable again (%d requests went by known routes)", self.known_routes_used
            )

    async def _renew(
        self, key: tuple[str, int], timeout_s: float, prefix: Callable[[], list[int]] | None
    ) -> Pick:
        model, kind = key
        epoch = self._router.epoch
        known = self._known(key)
        # The prompt's prefix goes along: if the router turns out to route this model by
        # prefix (cache_aware), this request is already placed by it. With a known route,
        # an unreachable router fails the call at once (the known route serves); without
        # one, the call waits for the router (bounded).
        fut = asyncio.ensure_future(
            self._router.route(
                model,
                kind=kind,
                want_lease=True,
                prefix_hashes=prefix() if prefix is not None else None,
                timeout_s=timeout_s,
                patient=known is None,
            )
        )
        self._renewing[key] = fut

        def settle(f: asyncio.Future[router_pb2.RouteResponse]) -> None:
            # Runs even when every request waiting on the call has gone away.
            if self._renewing.get(key) is f:
                del self._renewing[key]
            if f.cancelled() or f.exception() is not None:
                return
            self._router_back()
            resp = f.result()
            if resp.wants_prefix:
                self._by_prefix.add(model)
            if resp.lease_ms and resp.candidates and resp.address:
                self._leases[key] = _Lease(resp, epoch, self.inflight)
            else:
                self._leases.pop(key, None)

        fut.add_done_callback(settle)
        try:
            return _pick(await asyncio.shield(fut))
        except RouterUnreachable:
            known = self._known(key)
            if known is None:
                raise
            return self._use_known(known.pick(self.inflight))

    async def _session_route(self, model: str, session_id: str, timeout_s: float) -> Pick:
        key = (model, session_id)
        now = time.monotonic()
        pins = self._pins
        held = pins.get(key)
        known: Pick | None = None
        if held is not None:
            pick, expires, epoch = held
            if epoch == self._router.epoch:
                if expires > now:
                    return pick
                if expires + KNOWN_ROUTE_S > now:
                    known = pick
        epoch = self._router.epoch
        try:
            resp = await self._router.route(
                model,
                session_id=session_id,
                want_lease=True,
                timeout_s=timeout_s,
                patient=known is None,
            )
        except RouterUnreachable:
            if known is None:
                raise
            # The pin cannot have moved: nothing moves one while the router is away.
            return self._use_known(known)
        except ServiceError:
            # The router decided otherwise (the pinned proxy is down, the session is gone):
            # what this gateway knew no longer stands.
            pins.pop(key, None)
            raise
        self._router_back()
        pick = _pick(resp)
        pins.pop(key, None)
        if resp.lease_ms and resp.address:
            now = time.monotonic()
            while pins:
                first = next(iter(pins))
                if pins[first][1] + KNOWN_ROUTE_S > now:
                    break
                del pins[first]
            pins[key] = (pick, now + resp.lease_ms / 1000.0, epoch)
        return pick

    def invalidate(self, model: str | None = None) -> None:
        """Forget leases and session pins (of `model`, or all): the next request asks the
        router."""
        if model is None:
            self._leases.clear()
            self._pins.clear()
            return
        for key in [k for k in self._leases if k[0] == model]:
            del self._leases[key]
        for pin in [k for k in self._pins if k[0] == model]:
            del self._pins[pin]

    def acquire(self, address: str) -> None:
        self.inflight[address] = self.inflight.get(address, 0) + 1

    def release(self, address: str) -> None:
        left = self.inflight.get(address, 0) - 1
        if left > 0:
            self.inflight[address] = left
        else:
            self.inflight.pop(address, None)


def _pick(resp: router_pb2.RouteResponse) -> Pick:
    return Pick(resp.proxy_id, resp.address, resp.model)
