"""Polls each registered proxy's GetStats and records health and load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from areal_router.proxy_client import ProxyClients
from areal_router.registry import HEALTH_NAMES, HEALTHY, Registry
from areal_runtime.errors import ServiceError

log = logging.getLogger("areal_router.health")


class HealthPoller:
    """One task per proxy: poll, record, sleep `interval`, until unwatched."""

    def __init__(
        self,
        registry: Registry,
        clients: ProxyClients,
        *,
        interval: float,
        timeout: float,
        unhealthy_after: int,
        on_poll: Callable[[bool], None] | None = None,
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_after = unhealthy_after
        self._on_poll = on_poll
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()
        # Set once a watched proxy's first poll has an outcome.
        self._first_poll: dict[str, asyncio.Event] = {}

    def watch(self, proxy_id: str) -> None:
        """Start polling `proxy_id` now (restart if already polled: it may have moved)."""
        if self._stopped:
            return
        old = self._tasks.pop(proxy_id, None)
        if old is not None:
            old.cancel()
        self._first_poll[proxy_id] = asyncio.Event()
        self._tasks[proxy_id] = asyncio.get_running_loop().create_task(
            self._loop(proxy_id), name=f"health-{proxy_id}"
        )

    def unwatch(self, proxy_id: str) -> None:
        task = self._tasks.pop(proxy_id, None)
        if task is not None:
            task.cancel()
        first = self._first_poll.pop(proxy_id, None)
        if first is not None:
            first.set()
        drop = asyncio.get_running_loop().create_task(self.clients.drop(proxy_id))
        self._background.add(drop)
        drop.add_done_callback(self._background.discard)

    async def wait_first_poll(self, proxy_ids: Iterable[str], wait_s: float) -> None:
        """Wait (at most `wait_s` seconds) until each proxy's first poll has an outcome."""
        events = [e for e in (self._first_poll.get(pid) for pid in proxy_ids) if e is not None]
        if not events:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                for e in events:
                    await e.wait()

    @property
    def watched(self) -> set[str]:
        return set(self._tasks)

    async def poll_once(self, proxy_id: str) -> bool | None:
        """Poll one proxy and record the outcome. None if it is not registered."""
        proxy = self.registry.proxies.get(proxy_id)
        if proxy is None:
            return None
        address = proxy.address
        client = await self.clients.get(proxy_id, address)
        try:
            stats = await client.get_stats(self.timeout)
        except ServiceError as exc:
            current = self.registry.proxies.get(proxy_id)
            if current is None or current.address != address:
                return None  # re-registered meanwhile: this outcome is stale
            change = self.registry.record_failure(
                proxy_id, exc.message, unhealthy_after=self.unhealthy_after
            )
            self._log_change(proxy_id, change, exc.message)
            if self._on_poll:
                self._on_poll(False)
            return False
        current = self.registry.proxies.get(proxy_id)
        if current is None or current.address != address:
            return None
        change = self.registry.record_report(
            proxy_id,
            healthy=stats.healthy,
            draining=stats.draining,
            inflight_requests=stats.inflight_requests,
            inflight_tokens=stats.inflight_tokens,
            sessions=stats.sessions,
            model=stats.model,
            detail=stats.detail,
        )
        self._log_change(proxy_id, change, current.last_error)
        if self._on_poll:
            self._on_poll(True)
        return True

    def _log_change(self, proxy_id: str, change: tuple[int, int] | None, why: str) -> None:
        if change is None or change[0] == change[1]:
            return
        old, new = (HEALTH_NAMES.get(h, "unknown") for h in change)
        if change[1] == HEALTHY:
            log.info("proxy %s: %s -> %s", proxy_id, old, new)
        else:
            log.warning("proxy %s: %s -> %s (%s)", proxy_id, old, new, why)

    async def _loop(self, proxy_id: str) -> None:
        first = self._first_poll.get(proxy_id)
        while proxy_id in self.registry.proxies:
            try:
                await self.poll_once(proxy_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop health checks for good
                log.exception("proxy %s: poll failed unexpectedly", proxy_id)
            if first is not None:
                first.set()
                first = None
            await asyncio.sleep(self.interval)
        if self._tasks.get(proxy_id) is asyncio.current_task():
            del self._tasks[proxy_id]

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in [*tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
