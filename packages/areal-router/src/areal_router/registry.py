"""The router's state: models, proxies, their health and load, session pins.

Pure data (no gRPC, no I/O) plus `StateStore`, which persists the durable part
(models, proxies, pins; never health or load) to `--state-file`.

Everything here runs on the server's event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import Conflict, InvalidRequest, ModelExists
from areal_runtime.ready import write_private

log = logging.getLogger("areal_router.registry")

HEALTHY: int = router_pb2.PROXY_HEALTH_HEALTHY
UNHEALTHY: int = router_pb2.PROXY_HEALTH_UNHEALTHY
DRAINING: int = router_pb2.PROXY_HEALTH_DRAINING
HEALTH_NAMES: dict[int, str] = {HEALTHY: "healthy", UNHEALTHY: "unhealthy", DRAINING: "draining"}

INTERNAL: int = router_pb2.MODEL_KIND_INTERNAL
EXTERNAL: int = router_pb2.MODEL_KIND_EXTERNAL

STATE_FORMAT = 1
NOT_POLLED = "not polled yet"


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
    # Load as the proxy last reported it, plus what we routed since.
    reported_requests: int = 0
    reported_tokens: int = 0
    reported_sessions: int = 0
    routed_since_report: int = 0
    # Sessions pinned here (by BindSession or session_affinity).
    sessions: set[str] = field(default_factory=set)
    # Sequence number of the last time a policy chose it (tie-break: least recent).
    last_chosen: int = 0

    @property
    def routable(self) -> bool:
        return self.health == HEALTHY

    @property
    def load(self) -> int:
        """In-flight requests: the last report plus what was routed here since."""
        return self.reported_requests + self.routed_since_report

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
    """Models, proxies and session pins. Every mutation bumps `generation`."""

    def __init__(self) -> None:
        self.models: dict[str, ModelState] = {}
        self.proxies: dict[str, ProxyState] = {}
        # session id -> proxy id
        self.pins: dict[str, str] = {}
        self.generation = 0
        self._choice_seq = 0

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
        self.generation += 1

    def remove_model(self, name: str) -> tuple[bool, list[str]]:
        model = self.models.get(name)
        if model is None:
            return False, []
        proxy_ids = list(model.proxy_ids)
        for pid in proxy_ids:
            self._drop_proxy(pid)
        self.models.pop(name, None)
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
        if old is None:
            state = ProxyState(
                proxy_id=proxy_id,
                address=address,
                model=model,
                kind=kind,
                labels=dict(labels or {}),
            )
            self.proxies[proxy_id] = state
            m.proxy_ids.append(proxy_id)
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
                state.routed_since_report = 0
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
        for sid in state.sessions:
            self.pins.pop(sid, None)
        state.sessions.clear()
        m = self.models.get(state.model)
        if m is not None:
            with contextlib.suppress(ValueError):
                m.proxy_ids.remove(proxy_id)
            if m.implicit and not m.proxy_ids:
                del self.models[m.name]

    def proxies_of(self, model: str) -> Iterator[ProxyState]:
        m = self.models.get(model)
        if m is None:
            return
        for pid in m.proxy_ids:
            p = self.proxies.get(pid)
            if p is not None:
                yield p

    def candidates(self, model: str, kind: int = 0) -> list[ProxyState]:
        """Healthy proxies of `model` (of `kind` unless 0), in registration order."""
        return [p for p in self.proxies_of(model) if p.routable and (not kind or p.kind == kind)]

    def note_chosen(self, proxy: ProxyState, *, routed: bool) -> None:
        self._choice_seq += 1
        proxy.last_chosen = self._choice_seq
        if routed:
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
        now_ms: int | None = None,
    ) -> tuple[int, int] | None:
        """A successful GetStats. Returns (old, new) health, or None if unknown proxy."""
        p = self.proxies.get(proxy_id)
        if p is None:
            return None
        old = p.health
        p.failures = 0
        p.last_seen_unix_ms = int(time.time() * 1000) if now_ms is None else now_ms
        p.reported_requests = max(0, inflight_requests)
        p.reported_tokens = max(0, inflight_tokens)
        p.reported_sessions = max(0, sessions)
        p.routed_since_report = 0
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
        for sid in session_ids:
            prev = self.pins.get(sid)
            if prev is not None and prev != proxy.proxy_id:
                old = self.proxies.get(prev)
                if old is not None:
                    old.sessions.discard(sid)
            self.pins[sid] = proxy.proxy_id
            proxy.sessions.add(sid)
        self.generation += 1

    def unpin(self, session_ids: Iterable[str]) -> int:
        released = 0
        for sid in session_ids:
            pid = self.pins.pop(sid, None)
            if pid is None:
                continue
            released += 1
            p = self.proxies.get(pid)
            if p is not None:
                p.sessions.discard(sid)
        if released:
            self.generation += 1
        return released

    # -- persistence ----------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "models": [m.to_json() for m in self.models.values()],
            "proxies": [p.to_json() for p in self.proxies.values()],
            "pins": dict(self.pins),
        }

    def load_json(self, data: dict[str, Any]) -> None:
        """Replace the registry's content with a `to_json()` snapshot."""
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise ValueError(f"unsupported state format: {data.get('format')!r}")
        self.models.clear()
        self.proxies.clear()
        self.pins.clear()
        for m in data.get("models", []):
            self.models[m["name"]] = ModelState(
                name=m["name"],
                kind=int(m.get("kind", INTERNAL)),
                base_url=m.get("base_url", ""),
                api_key=m.get("api_key", ""),
                upstream_model=m.get("upstream_model", ""),
                created_unix_s=int(m.get("created_unix_s", 0)),
                implicit=bool(m.get("implicit", False)),
            )
        for p in data.get("proxies", []):
            model = self.models.get(p["model"])
            if model is None:
                model = self.models[p["model"]] = ModelState(name=p["model"], implicit=True)
            if model.kind == EXTERNAL:
                log.warning(
                    "state: dropping proxy %s of external model %s", p["proxy_id"], p["model"]
                )
                continue
            self.proxies[p["proxy_id"]] = ProxyState(
                proxy_id=p["proxy_id"],
                address=p["address"],
                model=p["model"],
                kind=int(p.get("kind", router_pb2.PROXY_KIND_INFERENCE)),
                labels=dict(p.get("labels", {})),
            )
            model.proxy_ids.append(p["proxy_id"])
        for sid, pid in dict(data.get("pins", {})).items():
            proxy = self.proxies.get(pid)
            if proxy is not None:
                self.pins[sid] = pid
                proxy.sessions.add(sid)
        self.generation += 1


class StateStore:
    """Writes the registry to `path` (atomic, 0600); `flush` after each change, before the
    change is acknowledged. Concurrent flushes share writes: one runs at a time, and the next
    writes everything changed meanwhile."""

    def __init__(self, path: str | Path, registry: Registry) -> None:
        self.path = Path(path)
        self.registry = registry
        self._saved_generation = -1
        self._lock = asyncio.Lock()

    def load(self) -> bool:
        """Load the file into the registry. False if there is none yet.

        A file that exists but cannot be read raises: starting empty would
        overwrite every registration with nothing.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return False
        try:
            self.registry.load_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"state file {self.path} is not a router state: {exc}") from exc
        self._saved_generation = self.registry.generation
        return True

    @property
    def dirty(self) -> bool:
        return self.registry.generation != self._saved_generation

    async def flush(self) -> None:
        """Return once every change made before the call is on disk."""
        async with self._lock:
            if not self.dirty:
                return
            generation = self.registry.generation
            data = json.dumps(self.registry.to_json(), sort_keys=True).encode()
            await asyncio.to_thread(write_private, self.path, data)
            self._saved_generation = generation
            log.debug("state: wrote %s (%d bytes)", self.path, len(data))

    async def close(self) -> None:
        await self.flush()
