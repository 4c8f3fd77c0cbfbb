"""Routing policies and the routing decision itself: pure, no I/O.

A policy only ever sees the healthy proxies of the requested model (of the
requested kind); `Router` builds that list, applies session pins first, and
keeps the load accounting (what it routed since each proxy's last report).
Each decision is O(#proxies of the model) (+ O(#prefix hashes) for cache_aware).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from areal_router.registry import (
    DRAINING,
    EXTERNAL,
    HEALTH_NAMES,
    UNHEALTHY,
    ModelState,
    ProxyState,
    Registry,
)
from areal_runtime.errors import (
    InvalidRequest,
    NoHealthyReplica,
    NotFound,
    ServiceError,
    SessionNotFound,
    Unavailable,
    UnknownModel,
)

POLICY_NAMES = ("round_robin", "least_loaded", "power_of_two", "session_affinity", "cache_aware")


@dataclass
class RouteContext:
    model: str
    session_id: str = ""
    prefix_hashes: Sequence[int] = field(default_factory=tuple)


# Least loaded first: in-flight requests, then tokens, then least recently chosen. A C-level
# getter: it runs for every candidate of every decision (1,000 at the largest services).
load_key: Callable[[ProxyState], tuple[int, int, int]] = attrgetter(
    "load", "reported_tokens", "last_chosen"
)


def placement_key(p: ProxyState) -> tuple[int, int, int]:
    """Where a new session goes: in-flight requests + pinned sessions, then tokens.

    Pinned sessions count because a burst of BindSession calls happens before
    any of those sessions sends a request (the proxies' reports would still
    say zero and every group would land on one proxy).
    """
    return (p.load + len(p.sessions), p.reported_tokens, p.last_chosen)


def least_loaded(candidates: Sequence[ProxyState]) -> ProxyState:
    return min(candidates, key=load_key)


def least_placed(candidates: Sequence[ProxyState]) -> ProxyState:
    return min(candidates, key=placement_key)


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        """Pick one of `candidates` (never empty; all healthy, all of ctx.model)."""
        ...

    def forget(self, proxy_id: str) -> None:
        """The proxy left the registry."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        i = self._next.get(ctx.model, 0)
        self._next[ctx.model] = i + 1
        return candidates[i % len(candidates)]

    def forget(self, proxy_id: str) -> None:
        return None

    def forget_model(self, model: str) -> None:
        self._next.pop(model, None)


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        return least_loaded(candidates)

    def forget(self, proxy_id: str) -> None:
        return None


class PowerOfTwo:
    """Two random healthy proxies; the less loaded one wins."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return min(candidates[a], candidates[b], key=load_key)

    def forget(self, proxy_id: str) -> None:
        return None


class SessionAffinity:
    """Requests without a session go to the least loaded proxy.

    (Sessions are placed and pinned by `Router` before a policy is asked.)
    """

    name = "session_affinity"

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        return least_loaded(candidates)

    def forget(self, proxy_id: str) -> None:
        return None


class CacheAware:
    """Prefix affinity: a prompt goes where its longest known prefix was last served.

    `prefix_hashes` are hashes of growing prefixes of the prompt (shortest
    first; 0 = unknown). The owner of the longest known prefix gets the request
    unless it is overloaded: its load exceeds the least loaded candidate's by
    more than `balance_abs` and by a factor of more than `balance_rel`. A
    shorter prefix's owner is tried next, then the least loaded proxy. The
    chosen proxy becomes the owner of every prefix of the prompt. The table is
    an LRU of at most `capacity` (model, hash) entries.
    """

    name = "cache_aware"

    def __init__(
        self, capacity: int = 1 << 16, balance_abs: int = 8, balance_rel: float = 1.5
    ) -> None:
        self.capacity = capacity
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._owner: OrderedDict[tuple[str, int], str] = OrderedDict()

    def overloaded(self, p: ProxyState, min_load: int) -> bool:
        return p.load - min_load > self.balance_abs and p.load > self.balance_rel * min_load

    def choose(self, candidates: Sequence[ProxyState], ctx: RouteContext) -> ProxyState:
        hashes = [h for h in ctx.prefix_hashes if h]
        if not hashes:
            return least_loaded(candidates)
        by_id = {p.proxy_id: p for p in candidates}
        min_load = min(p.load for p in candidates)
        chosen: ProxyState | None = None
        for h in reversed(hashes):
            owner = by_id.get(self._owner.get((ctx.model, h), ""))
            if owner is not None and not self.overloaded(owner, min_load):
                chosen = owner
                break
        if chosen is None:
            chosen = least_loaded(candidates)
        for h in hashes:
            key = (ctx.model, h)
            self._owner[key] = chosen.proxy_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return chosen

    def forget(self, proxy_id: str) -> None:
        stale = [k for k, v in self._owner.items() if v == proxy_id]
        for k in stale:
            del self._owner[k]

    def __len__(self) -> int:
        return len(self._owner)


def make_policies(rng: random.Random | None = None) -> dict[str, Policy]:
    policies: list[Policy] = [
        RoundRobin(),
        LeastLoaded(),
        PowerOfTwo(rng),
        SessionAffinity(),
        CacheAware(),
    ]
    by_name = {p.name: p for p in policies}
    assert tuple(by_name) == POLICY_NAMES
    return by_name


@dataclass
class Decision:
    model: ModelState
    proxy: ProxyState | None  # None for an external model
    policy: str
    # True when this call pinned a new session (the registry changed).
    pinned: bool = False


class Router:
    """The routing decision: model → pins → healthy candidates → policy."""

    def __init__(
        self,
        registry: Registry,
        default_policy: str = "round_robin",
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policies = make_policies(rng)
        if default_policy not in self.policies:
            raise ValueError(f"unknown policy {default_policy!r}")
        self.default_policy = default_policy

    def _model(self, name: str) -> ModelState:
        if not name:
            raise InvalidRequest("model is required", param="model")
        model = self.registry.models.get(name)
        if model is None:
            raise UnknownModel(f"model {name!r} is not registered", param="model")
        return model

    def _no_healthy(self, model: ModelState, kind: int) -> ServiceError:
        total = sum(1 for p in self.registry.proxies_of(model.name) if not kind or p.kind == kind)
        return NoHealthyReplica(
            f"model {model.name!r} has no healthy proxy ({total} registered)",
            code="no_healthy_proxy",
        )

    def _pinned(self, session_id: str, model: ModelState) -> ProxyState | None:
        pid = self.registry.pins.get(session_id)
        if pid is None:
            return None
        proxy = self.registry.proxies.get(pid)
        if proxy is None:  # cannot happen: pins leave with their proxy
            return None
        if proxy.model != model.name:
            raise InvalidRequest(
                f"session {session_id!r} belongs to model {proxy.model!r}, not {model.name!r}",
                code="session_model_mismatch",
                param="model",
            )
        # A draining proxy takes no new session, but its own sessions' turns still go there:
        # a retired one (graceful drain) serves them on other replicas' engines, and one
        # shutting down refuses them itself.
        if not proxy.routable and proxy.health != DRAINING:
            raise Unavailable(
                f"session {session_id!r} is pinned to proxy {proxy.proxy_id!r}, which is "
                f"{HEALTH_NAMES.get(proxy.health, 'unknown')}"
                + (f" ({proxy.last_error})" if proxy.last_error else ""),
                code="session_proxy_unavailable",
            )
        return proxy

    def pin_to_ask(self, session_id: str) -> str:
        """The proxy to poll before a Route of `session_id` is refused, or "".

        A session pinned to an unhealthy proxy fails fast, but only on fresh news: a proxy
        that answered its last poll and reported its engine down (a lost engine stream
        makes it suspect; proxy engine_health.py) may have it back already, and the
        session's retry is the moment that matters. Such a proxy is asked again, and it asks
        its engine. One whose polls fail (its process is gone) is not: that would only delay
        the refusal by a poll timeout."""
        pid = self.registry.pins.get(session_id)
        proxy = self.registry.proxies.get(pid) if pid is not None else None
        if proxy is None or proxy.health != UNHEALTHY or proxy.failures:
            return ""
        return proxy.proxy_id

    def route(
        self,
        model_name: str,
        *,
        session_id: str = "",
        prefix_hashes: Sequence[int] = (),
        kind: int = 0,
        policy: str = "",
    ) -> Decision:
        policy_name = policy or self.default_policy
        chosen_policy = self.policies.get(policy_name)
        if chosen_policy is None:
            raise InvalidRequest(
                f"unknown policy {policy_name!r} (one of {', '.join(self.policies)})",
                param="policy",
            )
        if not model_name and session_id:
            # "Where does this session live?" (rewards, exports): the pin decides, whatever
            # the proxy's health. Its records are there and nowhere else; an engine that is
            # down does not stop them being read, and a proxy that is down answers for
            # itself (the caller's call fails as unreachable).
            pid = self.registry.pins.get(session_id)
            proxy_state = self.registry.proxies.get(pid) if pid is not None else None
            if proxy_state is None:
                raise SessionNotFound(f"session {session_id!r} is not known to the router")
            self.registry.touch(session_id)
            return Decision(self._model(proxy_state.model), proxy_state, policy_name)
        model = self._model(model_name)
        if model.kind == EXTERNAL:
            return Decision(model, None, policy_name)
        if session_id:
            pinned = self._pinned(session_id, model)
            if pinned is not None:
                self.registry.touch(session_id)
                self.registry.note_chosen(pinned, routed=True)
                return Decision(model, pinned, policy_name)
        candidates = self.registry.candidates(model.name, kind)
        if not candidates:
            raise self._no_healthy(model, kind)
        if session_id and policy_name == SessionAffinity.name:
            proxy = least_placed(candidates)
            self.registry.pin((session_id,), proxy)
            self.registry.note_chosen(proxy, routed=True)
            return Decision(model, proxy, policy_name, pinned=True)
        proxy = chosen_policy.choose(
            candidates, RouteContext(model.name, session_id, prefix_hashes)
        )
        self.registry.note_chosen(proxy, routed=True)
        return Decision(model, proxy, policy_name)

    def bind(
        self, session_ids: Sequence[str], model_name: str, *, kind: int = 0, proxy_id: str = ""
    ) -> ProxyState:
        """Pin `session_ids` together to `proxy_id`, or to the least loaded healthy proxy."""
        ids = [s for s in session_ids if s]
        if not ids:
            raise InvalidRequest("session_ids is empty", param="session_ids")
        if proxy_id:
            proxy = self.registry.proxies.get(proxy_id)
            if proxy is None:
                raise NotFound(f"proxy {proxy_id!r} is not registered", code="proxy_not_found")
            if model_name and proxy.model != model_name:
                raise InvalidRequest(
                    f"proxy {proxy_id!r} serves model {proxy.model!r}, not {model_name!r}",
                    param="proxy_id",
                )
            if kind and proxy.kind != kind:
                raise InvalidRequest(f"proxy {proxy_id!r} is of another kind", param="kind")
            if not proxy.routable:
                raise Unavailable(
                    f"proxy {proxy_id!r} is {HEALTH_NAMES.get(proxy.health, 'unknown')}; "
                    f"cannot pin sessions {', '.join(ids)}",
                    code="proxy_unavailable",
                )
        else:
            model = self._model(model_name)
            if model.kind == EXTERNAL:
                raise InvalidRequest(
                    f"model {model.name!r} is external; sessions cannot be pinned to it",
                    code="model_is_external",
                    param="model",
                )
            candidates = self.registry.candidates(model.name, kind)
            if not candidates:
                raise self._no_healthy(model, kind)
            proxy = least_placed(candidates)
        self.registry.pin(ids, proxy)
        self.registry.note_chosen(proxy, routed=False)
        return proxy

    def release(
        self, session_ids: Sequence[str], *, with_bound: bool = False, consumed: bool = False
    ) -> int:
        return self.registry.unpin(session_ids, with_bound=with_bound, consumed=consumed)

    def forget_proxies(self, proxy_ids: Sequence[str]) -> None:
        for pid in proxy_ids:
            for p in self.policies.values():
                p.forget(pid)

    def forget_model(self, model: str) -> None:
        rr = self.policies.get(RoundRobin.name)
        if isinstance(rr, RoundRobin):
            rr.forget_model(model)
