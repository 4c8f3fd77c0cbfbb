"""What models exist: the router's registry, cached for at most `ttl` seconds.

`/v1/models` waits for a fresh list (one ListModels per `ttl` at most, shared by concurrent
callers). The generation path only asks `external(name)`, which never waits: it answers from
the snapshot and, when that is stale, refreshes it in the background. Registrations made
through this gateway update the snapshot at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from areal_gateway.clients import RouterClient
from areal_proto.router.v1 import router_pb2

log = logging.getLogger(__name__)

EXTERNAL = router_pb2.MODEL_KIND_EXTERNAL


class ModelCatalog:
    def __init__(self, router: RouterClient, ttl: float = 1.0) -> None:
        self._router = router
        self._ttl = ttl
        self._models: dict[str, router_pb2.ModelInfo] = {}
        self._external: dict[str, router_pb2.ModelInfo] = {}
        # External models registered through this gateway: the router may redact their key.
        self._local: dict[str, tuple[router_pb2.ModelInfo, float]] = {}
        self._fetched_at = float("-inf")
        self._attempted_at = float("-inf")
        self._inflight: asyncio.Task[None] | None = None

    def _stale(self) -> bool:
        return time.monotonic() - self._fetched_at > self._ttl

    async def _fetch(self) -> None:
        started = time.monotonic()
        models = await self._router.list_models()
        listed = {m.name: m for m in models}
        external = {}
        for m in models:
            if m.kind == EXTERNAL:
                local = self._local.get(m.name)
                external[m.name] = local[0] if (local is not None and not m.api_key) else m
        # Registered here while the list was on its way: not in it yet, but real.
        for name, (info, added_at) in self._local.items():
            if added_at >= started and name not in listed:
                listed[name] = info
                external[name] = info
        self._models = listed
        self._external = external
        self._fetched_at = time.monotonic()

    def _refresh(self) -> asyncio.Task[None]:
        if self._inflight is None or self._inflight.done():
            self._attempted_at = time.monotonic()
            self._inflight = asyncio.ensure_future(self._fetch())
        return self._inflight

    async def list(self) -> list[router_pb2.ModelInfo]:
        if self._stale():
            await asyncio.shield(self._refresh())
        return list(self._models.values())

    def external(self, name: str) -> router_pb2.ModelInfo | None:
        # Refresh in the background; a router that is down is asked again after `ttl`,
        # not on every request.
        now = time.monotonic()
        if (
            now - self._fetched_at > self._ttl
            and now - self._attempted_at > self._ttl
            and (self._inflight is None or self._inflight.done())
        ):
            task = self._refresh()
            task.add_done_callback(_log_failure)
        return self._external.get(name)

    def example_model(self) -> str:
        """A model to show in the API document's examples: an internal one first (by name),
        else an external one, else "" (none known). Never waits; refreshes when stale."""
        self.external("")
        internal = sorted(n for n, m in self._models.items() if m.kind != EXTERNAL)
        return internal[0] if internal else min(self._models, default="")

    def model_label(self, name: str) -> str:
        """`name` as a metrics label: a model the snapshot knows, else "unknown" (bounded:
        a client's made-up names never become series). Never waits."""
        return name if name in self._models or name in self._external else "unknown"

    def remember(self, model: router_pb2.ModelInfo) -> None:
        self._models[model.name] = model
        if model.kind == EXTERNAL:
            self._local[model.name] = (model, time.monotonic())
            self._external[model.name] = model

    def forget(self, name: str) -> None:
        self._models.pop(name, None)
        self._local.pop(name, None)
        self._external.pop(name, None)

    async def aclose(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            self._inflight.cancel()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("model list refresh failed: %r", task.exception())
