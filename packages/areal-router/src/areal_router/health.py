"""How each registered proxy's health and load reach the router.

Two channels per proxy, on the one gRPC connection the router keeps to it:

* **push**: a `grpc.health.v1.Health/Watch` stream, which every proxy already serves. It
  costs nothing while nothing changes; a proxy that stops serving (drain, shutdown) says so
  at once, and a proxy process that dies ends the stream (its connection closes).
* **polls** of `ProxyStatusService.GetStats`, for load and details. A proxy is polled every
  `interval` while anything happens on it (traffic routed or leased to it, a report that
  differs from the one before, any health other than healthy, no push stream). A proxy that
  is healthy, idle and unchanged, with its push stream open, is polled only every
  `idle_interval`: between polls the router knows its load exactly (what it routed there
  itself, `Registry.note_chosen`), and anything that makes it busy (a `Route` or a route
  lease naming it, a bind) brings the next poll forward to within `interval` (`nudge`).

So an idle fleet costs the router one small poll per proxy per `idle_interval` and nothing
else, while a dead proxy still stops getting work at once: a push stream that ends is
followed by an immediate poll, and if that poll fails too the proxy is unhealthy without
waiting for `unhealthy_after` failures (the connection is gone and a new one was refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from areal_router.proxy_client import ProxyClients, PushUnsupported
from areal_router.registry import HEALTH_NAMES, HEALTHY, Registry
from areal_runtime.errors import DeadlineExceeded, InternalAuthFailed, ServiceError

log = logging.getLogger("areal_router.health")

# Seconds a proxy whose polls time out stays routable after its last answer: a proxy busy
# with a flood (tokenizing, streaming on a loaded machine) answers a poll late, and taking
# that for a dead proxy turned a burst into 503 `no_healthy_proxy` while the engine worked.
# A refused connection or an error answer is not covered: only silence is.
SLOW_GRACE_S = 5.0

# Each idle poll comes after 80-100 % of the idle interval, so the phases that entering
# the idle cadence spread out (see _next_delay) do not line up again.
_IDLE_JITTER = 0.2


@dataclass
class _Tracked:
    """The poller's bookkeeping for one proxy."""

    poll_task: asyncio.Task[None] | None = None
    push_task: asyncio.Task[None] | None = None
    # Set once the first poll has an outcome (RegisterProxy answers after it).
    first_poll: asyncio.Event = field(default_factory=asyncio.Event)
    # The push stream is open and its last message said SERVING.
    push_up: bool = False
    # The last poll found the proxy idle and its report unchanged.
    quiet: bool = False
    # Polled on the idle cadence since the last poll.
    on_idle: bool = False
    # The push stream ended since the last successful poll: a failed poll is decisive.
    lost: bool = False
    polling: bool = False
    # Loop time of the next poll, and the future the poll loop sleeps on until then.
    due: float = 0.0
    waker: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    # A poll asked for (loop time) while one was in flight.
    again: float | None = None
    # The last poll was refused for the internal token (RegisterProxies reports it).
    refused_token: bool = False
    # A poll asked for by a pinned session's Route (`recheck`), shared by every such Route.
    recheck: asyncio.Task[bool | None] | None = None


class HealthPoller:
    """Per proxy: a push stream and a poll loop (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        clients: ProxyClients,
        *,
        interval: float,
        timeout: float,
        unhealthy_after: int,
        idle_interval: float | None = None,
        on_poll: Callable[[bool], None] | None = None,
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.interval = interval
        self.idle_interval = max(interval, idle_interval if idle_interval is not None else interval)
        self.timeout = timeout
        self.unhealthy_after = unhealthy_after
        self._on_poll = on_poll
        self._tracked: dict[str, _Tracked] = {}
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle --------------------------------------------------------

    def watch(self, proxy_id: str) -> None:
        """Start tracking `proxy_id` now (restart if already tracked: it may have moved)."""
        if self._stopped:
            return
        self._cancel(self._tracked.pop(proxy_id, None))
        t = self._tracked[proxy_id] = _Tracked()
        loop = asyncio.get_running_loop()
        t.poll_task = loop.create_task(self._poll_loop(proxy_id, t), name=f"health-{proxy_id}")
        t.push_task = loop.create_task(self._push_loop(proxy_id, t), name=f"push-{proxy_id}")

    def unwatch(self, proxy_id: str) -> None:
        self._cancel(self._tracked.pop(proxy_id, None))
        drop = asyncio.get_running_loop().create_task(self.clients.drop(proxy_id))
        self._background.add(drop)
        drop.add_done_callback(self._background.discard)

    @staticmethod
    def _cancel(t: _Tracked | None) -> None:
        if t is None:
            return
        for task in (t.poll_task, t.push_task, t.recheck):
            if task is not None:
                task.cancel()
        if t.timer is not None:
            t.timer.cancel()
        t.first_poll.set()

    async def wait_first_poll(self, proxy_ids: Iterable[str], wait_s: float) -> None:
        """Wait (at most `wait_s` seconds) until each proxy's first poll has an outcome."""
        events = [t.first_poll for t in (self._tracked.get(p) for p in proxy_ids) if t]
        if not events:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                for e in events:
                    await e.wait()

    def refused_token(self, proxy_id: str) -> bool:
        """Its last poll was refused for the router's internal token."""
        t = self._tracked.get(proxy_id)
        return t is not None and t.refused_token

    @property
    def watched(self) -> set[str]:
        return set(self._tracked)

    def is_idle(self, proxy_id: str) -> bool:
        """Whether the proxy is on the idle cadence (polled every `idle_interval`)."""
        t = self._tracked.get(proxy_id)
        return t is not None and self._idle(proxy_id, t)

    async def stop(self) -> None:
        self._stopped = True
        tracked = list(self._tracked.values())
        self._tracked.clear()
        for t in tracked:
            self._cancel(t)
        tasks = [task for t in tracked for task in (t.poll_task, t.push_task) if task]
        for task in [*tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- activity: polls come sooner ---------------------------------------

    def nudge(self, proxy_id: str) -> None:
        """Work was routed (or leased, or bound) to the proxy: its load and health matter
        now, so its next poll is at most one `interval` away. O(1): called per decision."""
        t = self._tracked.get(proxy_id)
        if t is not None:
            t.quiet = False
            self._poll_within(t, self.interval)

    def _poll_within(self, t: _Tracked, delay: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        when = self._on_grid(now, delay) if delay else now
        if t.polling:
            t.again = when if t.again is None else min(t.again, when)
            return
        if t.waker is None or t.waker.done() or when >= t.due:
            return
        t.due = when
        if t.timer is not None:
            t.timer.cancel()
        t.timer = loop.call_at(when, _wake, t.waker)

    async def recheck(self, proxy_id: str) -> None:
        """Poll the proxy now and wait for the outcome (bounded by `timeout`): a pinned
        session's request waits on its health. Routes that ask while the poll is out share
        it; a Route that goes away does not cancel it for the others."""
        t = self._tracked.get(proxy_id)
        if t is None:
            return
        task = t.recheck
        if task is None or task.done():
            task = t.recheck = asyncio.get_running_loop().create_task(
                self.poll_once(proxy_id), name=f"recheck-{proxy_id}"
            )
        # `wait` neither cancels the poll when this Route is cancelled nor raises its error.
        await asyncio.wait((task,))
        if not task.cancelled() and (exc := task.exception()) is not None:
            # The Route answers from what is known.
            log.error("proxy %s: recheck failed unexpectedly", proxy_id, exc_info=exc)

    # -- polls --------------------------------------------------------------

    async def poll_once(self, proxy_id: str) -> bool | None:
        """Poll one proxy and record the outcome. None if it is not registered."""
        proxy = self.registry.proxies.get(proxy_id)
        if proxy is None:
            return None
        t = self._tracked.get(proxy_id)
        address = proxy.address
        before = (proxy.health, proxy.reported_requests, proxy.reported_tokens)
        before_sessions = proxy.reported_sessions
        routed = len(proxy.routed_at)  # decided lately, arrived or not (see _idle)
        client = await self.clients.get(proxy_id, address)
        try:
            stats = await client.get_stats(self.timeout)
        except ServiceError as exc:
            current = self.registry.proxies.get(proxy_id)
            if current is None or current.address != address:
                return None  # re-registered meanwhile: this outcome is stale
            # After a lost connection, a refused new one is the proxy gone: no more work.
            lost = t is not None and t.lost
            change = self.registry.record_failure(
                proxy_id,
                f"connection lost, then {exc.message}" if lost else exc.message,
                unhealthy_after=_failures_allowed(
                    exc, lost, current.last_seen_unix_ms, current.failures, self.unhealthy_after
                ),
            )
            if t is not None:
                t.quiet = False
                t.refused_token = isinstance(exc, InternalAuthFailed)
            self._log_change(proxy_id, change, current.last_error)
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
            parsing=(stats.tool_call_parser, stats.reasoning_parser, stats.default_tool_prompt),
            version=stats.version,
            total_requests=stats.total_requests,
        )
        if t is not None:
            t.lost = False
            t.refused_token = False
            after = (current.health, current.reported_requests, current.reported_tokens)
            t.quiet = (
                routed == 0
                and after == before == (HEALTHY, 0, 0)
                and current.reported_sessions == before_sessions
            )
        self._log_change(proxy_id, change, current.last_error)
        if self._on_poll:
            self._on_poll(True)
        return True

    def _on_grid(self, now: float, delay: float) -> float:
        """The last tick (a multiple of `interval` on the loop clock) at most `delay` from
        now, and after now. Every proxy polls on the same ticks, so polls go out together:
        a poll alone cost the router ~1 ms of CPU (waking the loop and gRPC's poller for
        one call), one of a batch ~0.2 ms. No poll comes later than it would off the grid."""
        due = math.floor((now + delay) / self.interval) * self.interval
        return due if due > now else due + self.interval

    def _idle(self, proxy_id: str, t: _Tracked) -> bool:
        p = self.registry.proxies.get(proxy_id)
        return (
            t.quiet
            and t.push_up
            and p is not None
            and p.health == HEALTHY
            and not p.routed_at  # routed here lately, even if a report counted them
        )

    def _next_delay(self, proxy_id: str, t: _Tracked) -> float:
        was_idle, t.on_idle = t.on_idle, self._idle(proxy_id, t)
        if self.idle_interval <= self.interval or not t.on_idle:
            return self.interval
        if not was_idle:
            # Entering the idle cadence: at a random phase of it, so proxies that went
            # idle together (a registration, the end of a run) poll spread out.
            return random.uniform(self.interval, self.idle_interval)
        return self.idle_interval * (1 - _IDLE_JITTER * random.random())

    def _log_change(self, proxy_id: str, change: tuple[int, int] | None, why: str) -> None:
        if change is None or change[0] == change[1]:
            return
        old, new = (HEALTH_NAMES.get(h, "unknown") for h in change)
        if change[1] == HEALTHY:
            log.info("proxy %s: %s -> %s", proxy_id, old, new)
        else:
            log.warning("proxy %s: %s -> %s (%s)", proxy_id, old, new, why)

    async def _poll_loop(self, proxy_id: str, t: _Tracked) -> None:
        loop = asyncio.get_running_loop()
        while proxy_id in self.registry.proxies:
            t.polling = True
            try:
                await self.poll_once(proxy_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop health checks for good
                log.exception("proxy %s: poll failed unexpectedly", proxy_id)
            finally:
                t.polling = False
            t.first_poll.set()
            now = loop.time()
            t.due = self._on_grid(now, self._next_delay(proxy_id, t))
            if t.again is not None:
                t.due = min(t.due, max(now, t.again))
                t.again = None
            t.waker = loop.create_future()
            t.timer = loop.call_at(t.due, _wake, t.waker)
            try:
                await t.waker
            finally:
                t.timer.cancel()
                t.waker = None
        if self._tracked.get(proxy_id) is t:
            del self._tracked[proxy_id]

    # -- push -------------------------------------------------------------

    async def _push_loop(self, proxy_id: str, t: _Tracked) -> None:
        """Keep a Health/Watch stream open to the proxy; act on what it says."""
        while (proxy := self.registry.proxies.get(proxy_id)) is not None:
            client = await self.clients.get(proxy_id, proxy.address)
            try:
                async for serving in client.watch_serving():
                    self._on_push(proxy_id, t, serving)
            except PushUnsupported:
                log.info("proxy %s: no health stream; polled every %gs", proxy_id, self.interval)
                return
            except ServiceError:
                pass  # the connection is gone (or never came): handled below
            was_up = t.push_up
            t.push_up = False
            p = self.registry.proxies.get(proxy_id)
            if was_up and p is not None and p.health == HEALTHY:
                # Its process may be gone: find out now, not at the next poll.
                t.lost = True
                self._poll_within(t, 0.0)
            await asyncio.sleep(self.interval)

    def _on_push(self, proxy_id: str, t: _Tracked, serving: bool) -> None:
        p = self.registry.proxies.get(proxy_id)
        if p is None:
            return
        t.push_up = serving
        if serving:
            # Routable again only once a poll says so (and after its first poll).
            if p.health != HEALTHY and t.first_poll.is_set():
                self._poll_within(t, 0.0)
            return
        # Draining, retired, shutting down or its engine failed: the poll, sent now, says
        # which (a retired proxy keeps its pinned sessions, so it is not marked unhealthy
        # meanwhile: its sessions' next turns must not fail in that moment).
        t.quiet = False
        self._poll_within(t, 0.0)


def _failures_allowed(
    exc: ServiceError, lost: bool, last_seen_unix_ms: int, failures: int, unhealthy_after: int
) -> int:
    """Failed polls in a row that make a proxy unhealthy, after this one failed with `exc`.

    After a lost connection a refused new one is the proxy gone: 1. A poll that timed out
    (no refusal, no error answer) from a proxy that answered less than SLOW_GRACE_S ago is
    busy (its loop serving a flood), not gone: counted, but it does not make the proxy
    unroutable yet; a dead one refuses, a stopped one stays silent past the grace."""
    if lost:
        return 1
    if (
        isinstance(exc, DeadlineExceeded)
        and last_seen_unix_ms > 0
        and time.time() * 1000 - last_seen_unix_ms < SLOW_GRACE_S * 1000
    ):
        return max(unhealthy_after, failures + 2)
    return unhealthy_after


def _wake(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)
