"""The router's state: models, proxies, their health and load, session pins.

Pure data (no gRPC, no I/O). The durable part (models, proxies, pins; never health or
load) is persisted by `areal_router.store.StateStore`: every mutation here records the
key it touched in a dirty set, so a write costs O(keys changed), never O(state).

Everything here runs on the server's event loop, so no locks are needed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal_proto.router.v1 import router_pb2
from areal_router.admission import Admission
from areal_runtime.errors import Conflict, InvalidRequest, ModelExists

log = logging.getLogger("areal_router.registry")

HEALTHY: int = router_pb2.PROXY_HEALTH_HEALTHY
UNHEALTHY: int = router_pb2.PROXY_HEALTH_UNHEALTHY
DRAINING: int = router_pb2.PROXY_HEALTH_DRAINING
HEALTH_NAMES: dict[int, str] = {HEALTHY: "healthy", UNHEALTHY: "unhealthy", DRAINING: "draining"}

INTERNAL: int = router_pb2.MODEL_KIND_INTERNAL
EXTERNAL: int = router_pb2.MODEL_KIND_EXTERNAL

STATE_FORMAT = 1
# Seconds a routed request may take to show in its proxy's load report: the caller gets the
# decision, then opens its call to the proxy, which counts it once the call arrives (tens of
# ms, far more on a loaded machine). A report taken meanwhile does not count it yet.
REPORT_GRACE_S = 0.5
NOT_POLLED = "not polled yet"

# Bumped by every change that can change which proxies a decision may pick (a health or
# kind change, a proxy added or removed): `Registry.candidates` caches its lists until then.
_ROUTING_FIELDS = frozenset(("health", "kind", "model"))
_routing_epoch = [0]
_LOAD_FIELDS = frozenset(("reported_requests", "routed_since_report"))


@dataclass
class ModelState:
    name: str
    kind: int = INTERNAL
    base_url: str = ""
    api_key: str = ""
    upstream_model: str = ""
    created_unix_s: int = 0
    # Created by RegisterProxy for a model nobody registered; RegisterModel may
    # take it over, and it goes away with its last proxy.
    implicit: bool = False
    # Proxy ids serving the model, in registration order.
    proxy_ids: list[str] = field(default_factory=list)

    def to_proto(self, *, with_proxies: bool = True) -> router_pb2.ModelInfo:
        return router_pb2.ModelInfo(
            name=self.name,
            kind=self.kind,  # type: ignore[arg-type]
            base_url=self.base_url,
            api_key=self.api_key,
            upstream_model=self.upstream_model,
            created_unix_s=self.created_unix_s,
            proxy_ids=list(self.proxy_ids) if with_proxies else [],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "base_url": self.base_url,
            "api_key": self.api_key,
            "upstream_model": self.upstream_model,
            "created_unix_s": self.created_unix_s,
            "implicit": self.implicit,
        }


@dataclass
class ProxyState:
    proxy_id: str
    address: str
    model: str
    kind: int = router_pb2.PROXY_KIND_INFERENCE
    labels: dict[str, str] = field(default_factory=dict)
    # Routable only once a poll has said so (see README).
    health: int = UNHEALTHY
    failures: int = 0
    last_seen_unix_ms: int = 0
    last_error: str = NOT_POLLED
    # Load as the proxy last reported it, plus what we routed that the report may not count.
    reported_requests: int = 0
    reported_tokens: int = 0
    reported_sessions: int = 0
    routed_since_report: int = 0
    # When (monotonic s) each of the recent routes here was decided, oldest first: a report
    # only accounts for the routes older than `Registry.report_grace` (see record_report).
    routed_at: deque[float] = field(default_factory=deque)
    # The proxy's count of requests it has taken since it started, as last reported (-1:
    # not reported yet). Each report's increase is how many routes have arrived since the
    # report before: those are in its in-flight count or already done (see record_report).
    reported_total: int = -1
    # How many of the oldest `routed_at` have arrived (a report counted them): no longer
    # load, but still recent routes, which keep the proxy on the busy poll cadence.
    routed_arrived: int = 0
    # In-flight requests: the last report plus what was routed here since (kept up to date
    # by __setattr__: a plain attribute is what a C-level key getter reads fastest).
    load: int = field(default=0, init=False)
    # Sessions pinned here (by BindSession or session_affinity).
    sessions: set[str] = field(default_factory=set)
    # Sequence number of the last time a policy chose it (tie-break: least recent).
    last_chosen: int = 0
    # Registration order (persisted: a model's proxies come back in the same order).
    seq: int = 0
    # As the proxy last reported them (not persisted: the next poll says again): its
    # tool-call parser, reasoning parser, and whether it writes `tools` into the prompt.
    parsing: tuple[str, str, bool] = ("", "", False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _ROUTING_FIELDS:
            _routing_epoch[0] += 1
        elif name in _LOAD_FIELDS:
            load = getattr(self, "reported_requests", 0) + getattr(self, "routed_since_report", 0)
            object.__setattr__(self, "load", load)

    @property
    def routable(self) -> bool:
        return self.health == HEALTHY

    def to_proto(self) -> router_pb2.ProxyInfo:
        return router_pb2.ProxyInfo(
            proxy_id=self.proxy_id,
            address=self.address,
            model=self.model,
            kind=self.kind,  # type: ignore[arg-type]
            health=self.health,  # type: ignore[arg-type]
            inflight_requests=self.load,
            inflight_tokens=self.reported_tokens,
            sessions=len(self.sessions),
            last_seen_unix_ms=self.last_seen_unix_ms,
            last_error=self.last_error,
            labels=dict(self.labels),
            tool_call_parser=self.parsing[0],
            reasoning_parser=self.parsing[1],
            default_tool_prompt=self.parsing[2],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "proxy_id": self.proxy_id,
            "address": self.address,
            "model": self.model,
            "kind": self.kind,
            "labels": dict(self.labels),
        }


class Registry:
    """Models, proxies and session pins. Every mutation bumps `generation` and records the
    keys it touched in `dirty_models` / `dirty_proxies` / `dirty_pins` (the store writes
    those rows and clears the sets).

    Pins expire `pin_ttl` seconds after their last use (0: never). Use is a bind or a
    `touch` (a Route naming the session); `pin_used` keeps pins least recently used
    first, so `expire` pops only what expired: O(expired), never a scan of every pin.
    """

    def __init__(
        self,
        *,
        pin_ttl: float = 0.0,
        clock: Callable[[], float] = time.time,
        report_grace: float = REPORT_GRACE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.models: dict[str, ModelState] = {}
        self.proxies: dict[str, ProxyState] = {}
        # session id -> proxy id
        self.pins: dict[str, str] = {}
        # session id -> last use (unix s), least recently used first.
        self.pin_used: OrderedDict[str, float] = OrderedDict()
        self.pin_ttl = max(0.0, pin_ttl)
        # A use refreshes the stored time only once it is this stale: a session sending a
        # request per second must not cost a write per request. An expiry is therefore
        # late by at most this much (1% of the TTL, at most 10 minutes).
        self.touch_granularity = min(self.pin_ttl / 100, 600.0)
        self.clock = clock
        # A route counts as load on its proxy at once; a report replaces only the routes
        # decided more than this long before it (see record_report).
        self.report_grace = max(0.0, report_grace)
        self.monotonic = monotonic
        # Pins made together by one bind of several ids (a group pin, then its sessions):
        # session id -> the bind's first id, and first id -> the ids it still pins.
        # `unpin(..., with_bound=True)` of a first id ends the whole group.
        self.bound_by: dict[str, str] = {}
        self.bundles: dict[str, set[str]] = {}
        self.dirty_models: set[str] = set()
        self.dirty_proxies: set[str] = set()
        self.dirty_pins: set[str] = set()
        self.generation = 0
        # (model, kind) -> (routing epoch, healthy proxies): a decision at 1,000 replicas
        # must not rebuild this list each time.
        self._candidates: dict[tuple[str, int], tuple[int, list[ProxyState]]] = {}
        self._choice_seq = 0
        self._proxy_seq = 0
        # Admission control: follows the pins (a released pin settles its session).
        self.admission = Admission()

    @property
    def dirty(self) -> bool:
        return bool(
            self.dirty_models or self.dirty_proxies or self.dirty_pins or self.admission.dirty
        )

    # -- models ---------------------------------------------------------

    def add_model(self, model: ModelState) -> None:
        if not model.name:
            raise InvalidRequest("model name is required", param="name")
        if model.kind == router_pb2.MODEL_KIND_UNSPECIFIED:
            model.kind = INTERNAL
        if model.kind == EXTERNAL and not model.base_url:
            raise InvalidRequest("an external model needs a base_url", param="base_url")
        if model.kind == EXTERNAL and not model.upstream_model:
            model.upstream_model = model.name
        if not model.created_unix_s:
            model.created_unix_s = int(time.time())
        existing = self.models.get(model.name)
        if existing is not None and not existing.implicit:
            raise ModelExists(f"model {model.name!r} already exists", param="name")
        if existing is not None:
            # Take over a model RegisterProxy created: keep its proxies.
            if model.kind == EXTERNAL and existing.proxy_ids:
                raise ModelExists(f"model {model.name!r} has proxies; it cannot become external")
            model.proxy_ids = existing.proxy_ids
        model.implicit = False
        self.models[model.name] = model
        self.routing_changed()
        self.dirty_models.add(model.name)
        self.generation += 1

    def remove_model(self, name: str) -> tuple[bool, list[str]]:
        model = self.models.get(name)
        if model is None:
            return False, []
        proxy_ids = list(model.proxy_ids)
        for pid in proxy_ids:
            self._drop_proxy(pid)
        self.models.pop(name, None)
        self.dirty_models.add(name)
        self.admission.forget_model(name)
        self.generation += 1
        return True, proxy_ids

    # -- proxies --------------------------------------------------------

    def upsert_proxy(
        self,
        proxy_id: str,
        address: str,
        model: str,
        kind: int = router_pb2.PROXY_KIND_INFERENCE,
        labels: dict[str, str] | None = None,
    ) -> tuple[ProxyState, bool]:
        """Register (or re-register) a proxy. Returns (state, address_or_model_changed)."""
        if not proxy_id:
            raise InvalidRequest("proxy_id is required", param="proxy_id")
        if not address or ":" not in address:
            raise InvalidRequest(f"address must be host:port, got {address!r}", param="address")
        if not model:
            raise InvalidRequest("a proxy must name the model it serves", param="model")
        if kind == router_pb2.PROXY_KIND_UNSPECIFIED:
            kind = router_pb2.PROXY_KIND_INFERENCE
        m = self.models.get(model)
        if m is not None and m.kind == EXTERNAL:
            raise Conflict(
                f"model {model!r} is external; it has no proxies", code="model_is_external"
            )
        old = self.proxies.get(proxy_id)
        if old is not None and old.model != model:
            # Moving to another model: its pins belonged to the old model.
            self._drop_proxy(proxy_id)
            old = None
        if m is None:
            m = ModelState(
                name=model, kind=INTERNAL, created_unix_s=int(time.time()), implicit=True
            )
            self.models[model] = m
            self.dirty_models.add(model)
        if old is None:
            self._proxy_seq += 1
            state = ProxyState(
                proxy_id=proxy_id,
                address=address,
                model=model,
                kind=kind,
                labels=dict(labels or {}),
                seq=self._proxy_seq,
            )
            self.proxies[proxy_id] = state
            m.proxy_ids.append(proxy_id)
            self.routing_changed()
            changed = True
        else:
            state = old
            changed = state.address != address
            state.kind = kind
            state.labels = dict(labels or {})
            if changed:
                # A new process: forget what we knew about the old one.
                state.address = address
                state.health = UNHEALTHY
                state.failures = 0
                state.last_error = NOT_POLLED
                state.reported_requests = state.reported_tokens = state.reported_sessions = 0
                state.routed_at.clear()
                state.routed_since_report = 0
                state.reported_total = -1
                state.routed_arrived = 0
        self.dirty_proxies.add(proxy_id)
        self.generation += 1
        return state, changed

    def remove_proxy(self, proxy_id: str) -> bool:
        if proxy_id not in self.proxies:
            return False
        self._drop_proxy(proxy_id)
        self.generation += 1
        return True

    def _drop_proxy(self, proxy_id: str) -> None:
        state = self.proxies.pop(proxy_id, None)
        if state is None:
            return
        self.routing_changed()
        self.dirty_proxies.add(proxy_id)
        for sid in state.sessions:
            self.pins.pop(sid, None)
            self.pin_used.pop(sid, None)
            self._unbundle(sid)
        self.dirty_pins.update(state.sessions)
        self.admission.settle(state.sessions, consumed=False)
        state.sessions.clear()
        m = self.models.get(state.model)
        if m is not None:
            with contextlib.suppress(ValueError):
                m.proxy_ids.remove(proxy_id)
            if m.implicit and not m.proxy_ids:
                del self.models[m.name]
                self.dirty_models.add(m.name)

    def proxies_of(self, model: str) -> Iterator[ProxyState]:
        m = self.models.get(model)
        if m is None:
            return
        for pid in m.proxy_ids:
            p = self.proxies.get(pid)
            if p is not None:
                yield p

    def candidates(self, model: str, kind: int = 0) -> list[ProxyState]:
        """Healthy proxies of `model` (of `kind` unless 0), in registration order. Cached
        until the next routing change (the list is shared: callers must not modify it)."""
        key = (model, kind)
        cached = self._candidates.get(key)
        if cached is not None and cached[0] == _routing_epoch[0]:
            return cached[1]
        out = [p for p in self.proxies_of(model) if p.routable and (not kind or p.kind == kind)]
        self._candidates[key] = (_routing_epoch[0], out)
        return out

    @staticmethod
    def routing_changed() -> None:
        """Proxies joined or left a model: cached candidate lists are stale."""
        _routing_epoch[0] += 1

    def note_chosen(self, proxy: ProxyState, *, routed: bool) -> None:
        self._choice_seq += 1
        proxy.last_chosen = self._choice_seq
        if routed:
            recent = proxy.routed_at
            now = self.monotonic()
            recent.append(now)
            # Bounded even while no report comes (a proxy whose polls fail).
            if recent[0] < now - 60.0:
                _forget_routes(proxy, now - self.report_grace)
            else:
                proxy.routed_since_report += 1

    # -- health reports -------------------------------------------------

    def record_report(
        self,
        proxy_id: str,
        *,
        healthy: bool,
        draining: bool,
        inflight_requests: int,
        inflight_tokens: int,
        sessions: int,
        model: str = "",
        detail: str = "",
        parsing: tuple[str, str, bool] = ("", "", False),
        now_ms: int | None = None,
        version: int = 0,
        total_requests: int = 0,
    ) -> tuple[int, int] | None:
        """A successful GetStats. Returns (old, new) health, or None if unknown proxy.

        `total_requests`: the proxy's count of requests taken since it started (0: it does
        not say)."""
        p = self.proxies.get(proxy_id)
        if p is None:
            return None
        old = p.health
        p.failures = 0
        p.last_seen_unix_ms = int(time.time() * 1000) if now_ms is None else now_ms
        p.reported_requests = max(0, inflight_requests)
        p.reported_tokens = max(0, inflight_tokens)
        p.reported_sessions = max(0, sessions)
        # Optimistic accounting, reconciled here: a burst routed just before this report
        # (or while the poll was out) has not reached the proxy yet, so the report does not
        # count it. Dropping it would make the proxy look idle and draw the rest of the burst;
        # the routes younger than `report_grace` stay counted until a later report.
        # Routes that have reached the proxy since its last report are in this one (in flight
        # or already done): they leave the estimate now, oldest first, not after the grace.
        # Counted as load until then, a conversation's quick sequential turns (each done
        # before the next) looked like a backlog on the proxy that served them, and
        # cache_aware moved the conversation's prefix off a proxy that was idle.
        # Requests that came another way (a lease, a migration, n > 1 choices) may drop
        # routes still on their way: the estimate errs towards the report, as before there
        # was one.
        total = max(0, total_requests)
        if p.reported_total >= 0 and total >= p.reported_total:
            p.routed_arrived += total - p.reported_total
        p.reported_total = total
        _forget_routes(p, self.monotonic() - self.report_grace)
        p.parsing = parsing
        if not model or model == p.model:
            self.admission.observe_version(p.model, version)
        if model and model != p.model:
            # Never send model B's requests to a proxy that serves model A.
            p.health = UNHEALTHY
            p.last_error = f"proxy serves model {model!r}, registered for {p.model!r}"
        elif draining:
            p.health = DRAINING
            p.last_error = detail or "draining"
        elif not healthy:
            p.health = UNHEALTHY
            p.last_error = detail or "proxy reports unhealthy"
        else:
            p.health = HEALTHY
            p.last_error = ""
        return old, p.health

    def record_failure(
        self, proxy_id: str, error: str, *, unhealthy_after: int
    ) -> tuple[int, int] | None:
        """A failed GetStats. Returns (old, new) health, or None if unknown proxy."""
        p = self.proxies.get(proxy_id)
        if p is None:
            return None
        old = p.health
        p.failures += 1
        p.last_error = error
        if p.failures >= unhealthy_after:
            p.health = UNHEALTHY
        return old, p.health

    # -- session pins ---------------------------------------------------

    def pin(self, session_ids: Iterable[str], proxy: ProxyState) -> None:
        now = self.clock()
        ids = list(session_ids)
        head = ids[0] if len(ids) > 1 else ""
        for sid in ids:
            self._unbundle(sid)
            if head:
                self.bound_by[sid] = head
                self.bundles.setdefault(head, set()).add(sid)
            prev = self.pins.get(sid)
            if prev is not None and prev != proxy.proxy_id:
                old = self.proxies.get(prev)
                if old is not None:
                    old.sessions.discard(sid)
            self.pins[sid] = proxy.proxy_id
            proxy.sessions.add(sid)
            self.pin_used[sid] = now
            self.pin_used.move_to_end(sid)
            self.dirty_pins.add(sid)
        self.generation += 1

    def unpin(
        self, session_ids: Iterable[str], *, with_bound: bool = False, consumed: bool = False
    ) -> int:
        """Release pins; with `with_bound`, also those a listed id's bind made with it when
        that id came first (a group pin's sessions), while that bind still pins them. The
        admitted sessions among them are settled: consumed (exported and acknowledged) when
        `consumed`, else dropped."""
        ids = list(session_ids)
        if with_bound:
            ids += [sid for head in ids for sid in self.bundles.get(head, ())]
        released = 0
        gone: list[str] = []
        for sid in ids:
            pid = self.pins.pop(sid, None)
            if pid is None:
                continue
            released += 1
            gone.append(sid)
            self.pin_used.pop(sid, None)
            self._unbundle(sid)
            self.dirty_pins.add(sid)
            p = self.proxies.get(pid)
            if p is not None:
                p.sessions.discard(sid)
        if released:
            self.admission.settle(gone, consumed=consumed)
            self.generation += 1
        return released

    def _unbundle(self, session_id: str) -> None:
        head = self.bound_by.pop(session_id, None)
        if head is None:
            return
        members = self.bundles.get(head)
        if members is not None:
            members.discard(session_id)
            if not members:
                del self.bundles[head]

    def touch(self, session_id: str) -> None:
        """The pinned session was used: its TTL starts over (O(1)), and so does that of the
        pin it was bound with first (a group pin: nothing routes by it until the group is
        exported, however long its sessions keep working). The new time is written with the
        next commit, not waited for: losing it on a crash only makes the pin expire up to
        `touch_granularity` + one sweep earlier."""
        if not self.pin_ttl:
            return
        now = self.clock()
        self._touch(session_id, now)
        head = self.bound_by.get(session_id)
        if head is not None and head != session_id:
            self._touch(head, now)

    def _touch(self, session_id: str, now: float) -> None:
        used = self.pin_used.get(session_id)
        if used is None or now - used < self.touch_granularity:
            return
        self.pin_used[session_id] = now
        self.pin_used.move_to_end(session_id)
        self.dirty_pins.add(session_id)

    def expire(self) -> list[str]:
        """Release the pins unused for `pin_ttl` seconds; returns their session ids.
        O(expired): `pin_used` is oldest first, so this stops at the first live pin."""
        if not self.pin_ttl:
            return []
        cutoff = self.clock() - self.pin_ttl
        expired: list[str] = []
        for sid, used in self.pin_used.items():
            if used > cutoff:
                break
            expired.append(sid)
        if expired:
            self.unpin(expired)
        return expired

    # -- persistence ----------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "models": [m.to_json() for m in self.models.values()],
            "proxies": [p.to_json() for p in self.proxies.values()],
            "pins": dict(self.pins),
        }

    def load_json(self, data: dict[str, Any]) -> None:
        """Replace the registry's content with a `to_json()` snapshot (the state file of
        routers before the SQLite store; pins from it count as used now)."""
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise ValueError(f"unsupported state format: {data.get('format')!r}")
        now = self.clock()
        self.load_rows(
            data.get("models", []),
            data.get("proxies", []),
            ((sid, pid, now) for sid, pid in dict(data.get("pins", {})).items()),
        )

    def load_rows(
        self,
        models: Iterable[dict[str, Any]],
        proxies: Iterable[dict[str, Any]],
        pins: Iterable[tuple[str, str, float] | tuple[str, str, float, str]],
    ) -> None:
        """Replace the registry's content: model and proxy documents (`to_json()` of each,
        a proxy's with its `seq`; proxies in registration order) and (session, proxy, last
        use[, first id of its bind]) pins. Rows that no longer fit (a proxy of an external
        model, a pin of an unknown proxy) are dropped and marked dirty, so the next write
        removes them from the store as well."""
        self.routing_changed()
        self.models.clear()
        self.proxies.clear()
        self.pins.clear()
        self.pin_used.clear()
        self.bound_by.clear()
        self.bundles.clear()
        for m in models:
            self.models[m["name"]] = ModelState(
                name=m["name"],
                kind=int(m.get("kind", INTERNAL)),
                base_url=m.get("base_url", ""),
                api_key=m.get("api_key", ""),
                upstream_model=m.get("upstream_model", ""),
                created_unix_s=int(m.get("created_unix_s", 0)),
                implicit=bool(m.get("implicit", False)),
            )
        for p in proxies:
            model = self.models.get(p["model"])
            if model is None:
                model = self.models[p["model"]] = ModelState(name=p["model"], implicit=True)
                self.dirty_models.add(p["model"])
            if model.kind == EXTERNAL:
                log.warning(
                    "state: dropping proxy %s of external model %s", p["proxy_id"], p["model"]
                )
                self.dirty_proxies.add(p["proxy_id"])
                continue
            # Keep stored sequence numbers, so proxies registered after a restart still
            # sort after these at the next one.
            self._proxy_seq = max(self._proxy_seq + 1, int(p.get("seq", 0)))
            self.proxies[p["proxy_id"]] = ProxyState(
                proxy_id=p["proxy_id"],
                address=p["address"],
                model=p["model"],
                kind=int(p.get("kind", router_pb2.PROXY_KIND_INFERENCE)),
                labels=dict(p.get("labels", {})),
                seq=self._proxy_seq,
            )
            model.proxy_ids.append(p["proxy_id"])
        # Least recently used first, as `pin` keeps them.
        for row in sorted(pins, key=lambda row: row[2]):
            sid, pid, used = row[0], row[1], row[2]
            proxy = self.proxies.get(pid)
            if proxy is None:
                self.dirty_pins.add(sid)
                continue
            self.pins[sid] = pid
            self.pin_used[sid] = float(used)
            proxy.sessions.add(sid)
            head = row[3] if len(row) > 3 else ""
            if head:
                self.bound_by[sid] = head
                self.bundles.setdefault(head, set()).add(sid)
        self.generation += 1

    def mark_all_dirty(self) -> None:
        """Every row is to be written (a migration into an empty store)."""
        self.dirty_models.update(self.models)
        self.dirty_proxies.update(self.proxies)
        self.dirty_pins.update(self.pins)
        self.admission.mark_all_dirty()


def _forget_routes(p: ProxyState, cutoff: float) -> None:
    """Forget the routes decided by `cutoff` (arrived ones first: they are the oldest) and
    recount the load of those that have not arrived."""
    recent = p.routed_at
    before = len(recent)
    _forget_before(recent, cutoff)
    arrived = min(len(recent), max(0, p.routed_arrived - (before - len(recent))))
    p.routed_arrived = arrived
    p.routed_since_report = len(recent) - arrived


def _forget_before(recent: deque[float], cutoff: float) -> None:
    while recent and recent[0] <= cutoff:
        recent.popleft()
