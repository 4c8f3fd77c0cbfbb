"""What `GET /health` reports about the service behind the gateway.

`/health` stays 200 while this gateway itself works: the CLI's watchdog probes it to find a
hung gateway, and a 503 there would have it restart a healthy gateway because a replica is
down. The service's truth goes in the body instead: `"status": "degraded"` when a model has
fewer healthy replicas than registered ones (none at all included), or when the router cannot
be asked, with each model's `{"healthy", "total"}` replicas.

The numbers are the router's listing (ListModels + ListProxies), fetched at most once per
`ttl` and shared by concurrent probes. A probe waits for a fresh listing at most `wait_s`,
then answers from the last one it has: a slow router never holds `/health` up for long, and a
listing older than `stale_after` says so (`"router": "not_answering"`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from areal_gateway.clients import RouterClient
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import InternalAuthFailed, ServiceError

log = logging.getLogger(__name__)

_HEALTHY = router_pb2.PROXY_HEALTH_HEALTHY
_EXTERNAL = router_pb2.MODEL_KIND_EXTERNAL


class ServiceHealth:
    def __init__(
        self,
        router: RouterClient,
        *,
        ttl: float = 1.0,
        wait_s: float = 0.25,
        stale_after: float = 5.0,
    ) -> None:
        self._router = router
        self._ttl = ttl
        self._wait_s = wait_s
        self._stale_after = stale_after
        # The last listing: {"router": "ok", "models": {name: {"healthy", "total"}}}, or the
        # router's failure ({"router": "unreachable" | "internal_auth_failed", "error"}).
        self._last: dict[str, Any] | None = None
        self._listed_at = float("-inf")  # last successful listing
        self._attempted_at = float("-inf")
        self._task: asyncio.Task[None] | None = None

    async def _fetch(self) -> None:
        try:
            models, proxies = await asyncio.gather(
                self._router.list_models(), self._router.list_proxies()
            )
        except InternalAuthFailed as exc:
            self._last = {"router": "internal_auth_failed", "error": exc.message}
            return
        except ServiceError as exc:
            self._last = {"router": "unreachable", "error": exc.message}
            return
        counts: dict[str, dict[str, int]] = {
            m.name: {"healthy": 0, "total": 0} for m in models if m.kind != _EXTERNAL
        }
        for p in proxies:
            c = counts.setdefault(p.model, {"healthy": 0, "total": 0})
            c["total"] += 1
            c["healthy"] += p.health == _HEALTHY
        self._last = {"router": "ok", "models": dict(sorted(counts.items()))}
        self._listed_at = time.monotonic()

    async def report(self) -> dict[str, Any]:
        """`{"status": "ok" | "degraded", "router", "models"?, "error"?}`."""
        now = time.monotonic()
        if now - self._attempted_at > self._ttl and (self._task is None or self._task.done()):
            self._attempted_at = now
            self._task = asyncio.ensure_future(self._fetch())
            self._task.add_done_callback(_log_failure)
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self._wait_s)
            except TimeoutError:
                pass  # answer from the last listing; the fetch goes on for the next probe
        last = dict(self._last or {"router": "unknown"})
        if last.get("router") == "ok" and time.monotonic() - self._listed_at > self._stale_after:
            last["router"] = "not_answering"
        models = last.get("models") or {}
        degraded = last.get("router") != "ok" or any(
            c["healthy"] < c["total"] or c["total"] == 0 for c in models.values()
        )
        return {"status": "degraded" if degraded else "ok", **last}

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("health listing failed: %r", task.exception())
