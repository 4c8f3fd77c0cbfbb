"""Whether the engine is making progress, from the proxy's own traffic with it.

A busy engine answers its health probe late: SGLang's `/health` generates one token and
waits for any output of the scheduler, so a long prefill (a 17k-token prompt on a CPU), a
big batch, or an event loop serving 64 streams keeps it from answering within the probe's
timeout. Taking that for a lost engine turned overload into an outage (the proxy went
NOT_SERVING, the router stopped routing to it, requests tried to migrate to peers that did
not exist, the CLI watchdog restarted an engine that was only busy). So a slow probe is not
a verdict; progress is:

* a sign of life is a token (a stream chunk), a whole answer, an engine's refusal of a
  request, or a probe answered in time;
* work that begins on an idle engine starts the clock (an engine that has had nothing to
  do owes no tokens);
* an engine never seen alive (a proxy just started) has no grace: its probe must answer;
* the engine is *stalled* once no sign of life came for `stall_timeout` seconds; before
  that, a probe that does not answer in time means *busy*.

A probe that is answered with a failure (connection refused, an error status) is decisive at
once (engine_health.py): that engine is gone or says it is not well, whatever it did before.

`TrackedEngine` is the proxy's engine client with this bookkeeping: every engine call of the
generation loop passes through it, so nothing above it has to report progress.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from areal_proxy.engine.base import (
    EngineClient,
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
)

# Seconds without any sign of life, with a probe that does not answer, after which the
# engine counts as stalled (--engine-stall-timeout).
DEFAULT_STALL_TIMEOUT_S = 60.0


class EngineProgress:
    """Requests at the engine and the last sign of life (the clock is injectable)."""

    def __init__(
        self,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_timeout = stall_timeout
        self._clock = clock
        self.inflight = 0
        # None until the first sign of life.
        self.last_sign: float | None = None

    def alive(self) -> None:
        """A token, an answer or a probe answered in time."""
        self.last_sign = self._clock()

    def begin(self) -> None:
        """A request goes to the engine. On an idle engine the clock starts now."""
        if self.inflight == 0 and self.last_sign is not None:
            self.last_sign = max(self.last_sign, self._clock())
        self.inflight += 1

    def end(self) -> None:
        self.inflight = max(0, self.inflight - 1)

    def silent_for(self) -> float:
        """Seconds since the last sign of life (infinite: never seen alive)."""
        if self.last_sign is None:
            return float("inf")
        return max(0.0, self._clock() - self.last_sign)

    def stalled(self) -> bool:
        """No sign of life for longer than the stall timeout (or never any)."""
        return self.silent_for() > self.stall_timeout

    def judge(self, probe: bool | None) -> tuple[bool, bool]:
        """(healthy, busy) after a probe: True answered in time, False answered a failure
        (or refused the connection), None no answer in time."""
        if probe is True:
            self.alive()
            return True, False
        if probe is False:
            return False, False
        if self.stalled():
            return False, False
        return True, True

    def describe(self) -> str:
        """What a stalled or busy engine's detail says."""
        if self.last_sign is None:
            return "no answer from the engine yet"
        return (
            f"{self.inflight} request(s) at the engine, last sign of life "
            f"{self.silent_for():.1f}s ago (stall timeout {self.stall_timeout:g}s)"
        )


class TrackedEngine:
    """An engine client whose generation calls report to `progress`; everything else
    (pause, resume, weights, limits) is the wrapped client's own."""

    def __init__(self, engine: EngineClient, progress: EngineProgress) -> None:
        self.inner = engine
        self.progress = progress
        self.base_url = engine.base_url

    def __getattr__(self, name: str) -> Any:
        # Only for what this class does not define (optional control calls).
        return getattr(self.inner, name)

    async def health(self) -> bool | None:
        return await self.inner.health()

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        p = self.progress
        p.begin()
        try:
            res = await self.inner.generate(req)
            p.alive()
            return res
        except EngineError as e:
            if e.refused:  # the engine answered about the request
                p.alive()
            raise
        finally:
            p.end()

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        p = self.progress
        p.begin()
        try:
            async with aclosing(self.inner.generate_stream(req)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    p.alive()
                    yield chunk
        except EngineError as e:
            if e.refused:
                p.alive()
            raise
        finally:
            p.end()

    async def abort(self, rid: str | None = None) -> None:
        await self.inner.abort(rid)

    async def close(self) -> None:
        await self.inner.close()
