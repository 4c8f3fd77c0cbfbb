"""What the proxy knows of its engine's health, and the one check that finds it out.

Three things ask the engine (`EngineClient.health`), and they share the check in flight:

* the background check, every --engine-health-interval;
* a request whose engine call failed as if the engine were gone (`failed`): the engine is
  *suspect* from then on and checked at once. A dropped connection is not a dead engine, and
  on a model's only replica a suspicion that lasted until the next background check refused
  the harness's immediate retry (an unmodified harness's: the router answered 529
  `session_proxy_unavailable` for seconds while the engine answered);
* `GetStats` while the engine is not known healthy (`verdict`): the router asks because
  work may be waiting on the answer (a pinned session's retry), so it hears what the engine
  says now, within the poll's deadline, not what it said up to an interval ago.

A probe is one of three answers (`EngineClient.health`): healthy, failed (a refused
connection, an error status: decisive at once), or no answer in time. The last is no verdict
by itself: a busy engine answers late too (SGLang's `/health` waits for a token of its own),
so the engine's progress decides (engine/progress.py): it stays healthy, reported *busy*,
until it has shown no sign of life for --engine-stall-timeout.

A check's answer is what `GetStats`, the grpc.health stream and `areal_proxy_engine_healthy`
say. A client that goes away is no failure of the engine and never gets here (the request
is cancelled, and `ServicerBase.run_generation` lets that propagate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from areal_proxy.engine.base import EngineClient
from areal_proxy.engine.progress import EngineProgress

if TYPE_CHECKING:
    from areal_proxy.serving.state import ProxyState

log = logging.getLogger("areal_proxy")


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class EngineHealth:
    def __init__(
        self,
        engine: EngineClient,
        state: ProxyState,
        gauge: _Gauge,
        *,
        learn_limit: Callable[[bool], Awaitable[None]],
        publish: Callable[[bool], Awaitable[None]],
        progress: EngineProgress | None = None,
        busy_gauge: _Gauge | None = None,
    ) -> None:
        self.engine = engine
        self.progress = progress if progress is not None else EngineProgress()
        self._busy_gauge = busy_gauge
        self.state = state
        self._gauge = gauge
        # Reads what the engine takes (on a (re)connection: its argument says so).
        self._learn_limit = learn_limit
        # Says the verdict on the grpc.health stream.
        self._publish = publish
        self._task: asyncio.Task[None] | None = None
        # A failure came while a check was asking: that check's answer may predate it.
        self._again = False

    def check(self) -> asyncio.Task[None]:
        """The check in flight, or a new one. Await it through `asyncio.shield` where the
        waiter may be cancelled: other askers share it."""
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.get_running_loop().create_task(
                self._check(), name="engine-check"
            )
        return task

    def failed(self, why: str) -> None:
        """A request's engine call failed as if the engine were gone: suspect until the
        check started now answers (until then `GetStats` waits for that answer)."""
        st = self.state
        if st.retired or not st.engine_healthy:
            # Retired: its engine was handed back. Not healthy: already suspect or down,
            # and the next poll or background check asks again.
            return
        st.engine_healthy = False
        st.engine_detail = f"engine call failed: {why}"
        self._gauge.set(0)
        log.warning("engine suspect, checking it now: %s", why)
        if self._task is not None and not self._task.done():
            self._again = True
        else:
            self.check()

    async def verdict(self, within: float) -> None:
        """If the engine is not known healthy, check it (or join the check in flight) and
        wait at most `within` seconds for the answer."""
        st = self.state
        if st.engine_healthy or st.retired or st.draining or within <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.check()), within)

    async def close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _check(self) -> None:
        st = self.state
        if st.retired:
            # Its engine was handed back (and is stopped): nothing to check.
            st.engine_detail = "retired"
            return
        while True:
            self._again = False
            probe = await self._ask()
            if not self._again:
                break
        p = self.progress
        ok, busy = p.judge(probe)
        if ok != st.engine_healthy:
            log.log(logging.INFO if ok else logging.WARNING, "engine %s", _word(ok))
        if busy and not st.engine_busy:
            log.info("engine busy (its health check did not answer in time): %s", p.describe())
        st.engine_healthy = ok
        st.engine_busy = busy
        if ok:
            st.engine_detail = ""
        elif probe is None:
            st.engine_detail = f"engine at {st.engine_url} stalled: {p.describe()}"
        else:
            st.engine_detail = f"engine at {st.engine_url} failed its health check"
        self._gauge.set(1 if ok else 0)
        if self._busy_gauge is not None:
            self._busy_gauge.set(1 if busy else 0)
        # Every verdict, not only a change: a suspicion changed nothing on the stream, and a
        # watcher is sent a status only when it differs from the one it was sent last.
        await self._publish(ok)

    async def _ask(self) -> bool | None:
        try:
            ok = await self.engine.health()
            if ok:  # what the engine takes, read when it (re)connects (inference/core.py)
                await self._learn_limit(not self.state.engine_healthy)
        except Exception as e:  # a shared check must end with an answer
            log.warning("engine health check raised: %r", e)
            return False
        return ok


def _word(ok: bool) -> str:
    return "healthy" if ok else "unhealthy"
