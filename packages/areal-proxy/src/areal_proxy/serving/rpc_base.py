"""What every RPC of the inference servicer shares: the error a client is told (an engine's
failure in the proxy's own words, an engine that looks gone checked at once), the request
counters, and the bookkeeping of one generation request (draining, the --max-inflight bound,
the deadline, its span, latency). The RPC groups (generate_rpcs.py, session_rpcs.py,
control_rpcs.py) build on it; the multiplexed `Generate` stream runs its requests through
`ServicerBase.run_generation`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from areal_proto.common.v1 import envelope_pb2
from areal_proxy.engine.base import EngineError
from areal_proxy.engine.peer import REQUEST_DEADLINE
from areal_proxy.generation.controller import GenerationController
from areal_proxy.generation.migration import MigrationFailed
from areal_proxy.inference import InferenceHandler
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.serving.metrics import ProxyMetrics
from areal_proxy.serving.state import ProxyState
from areal_runtime import tracing
from areal_runtime.errors import (
    DeadlineExceeded,
    Draining,
    InternalError,
    Overloaded,
    ServiceError,
    error_for,
)

if TYPE_CHECKING:
    from areal_proxy.serving.engine_health import EngineHealth

log = logging.getLogger(__name__)

# Our own deadline fires this much before the gRPC one, so the caller gets a 504 with an
# error detail (and the engine request is aborted) rather than a bare transport timeout.
DEADLINE_MARGIN_S = 0.02
# Retry-After of a request refused past --max-inflight: a generation on a busy CPU engine
# takes seconds, so sooner would mostly be refused again.
_OVERLOADED_RETRY_S = 2


def _in_own_words(err: ServiceError) -> ServiceError:
    """A generation's `engine_error` as its client is told it. The engine's own words (a
    grammar matcher's assertion, the last line of a Python traceback, its URL) mean nothing
    to a client and may show the inside of the service: the client is told what failed and
    what to do; `_fail` logs the words. (A control call's error, such as a checkpoint the
    engine could not load, keeps them: its caller is the operator.)"""
    if err.code != "engine_error" or err.http_status < 500:
        return err
    return error_for(
        err.http_status,
        "The engine serving this model failed while generating the answer; send the request "
        "again (the proxy's log has the engine's error).",
        type="api_error",
        code="engine_error",
    )


def _service_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded("generation did not finish before the request deadline")
    if isinstance(exc, EngineError):
        # The engine's own status, as the class for it (a 503 is `Unavailable`, so the
        # gateway may try another replica); type and code say it was the engine. A lost
        # engine's error reaches a client only as `migration_failed` (why the request could
        # not move) or, from a continuation for another replica, as `engine_lost` (that
        # replica tries its next peer).
        if isinstance(exc, MigrationFailed):
            code = MigrationFailed.code
        elif exc.lost:
            code = "engine_lost"
        else:
            code = "engine_unavailable" if exc.status == 503 else "engine_error"
        return error_for(
            exc.status, str(exc), type="api_error" if exc.status >= 500 else None, code=code
        )
    log.exception("internal error", exc_info=exc)
    return InternalError(f"internal proxy error: {type(exc).__name__}: {exc}")


class ServicerBase:
    """The servicer's state and the bookkeeping its RPC groups share."""

    def __init__(
        self,
        *,
        handler: InferenceHandler,
        controller: GenerationController,
        metrics: ProxyMetrics,
        state: ProxyState,
        engine_health: EngineHealth,
        request_timeout: float,
        book: SessionBook | None = None,
        max_inflight: int = 0,
    ) -> None:
        self.book = book
        # Generation requests held at once; past it a new one is refused (0: no bound).
        self.max_inflight = max_inflight
        self.engine_health = engine_health
        self.handler = handler
        self.controller = controller
        self.metrics = metrics
        self.state = state
        self.request_timeout = request_timeout
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._rpc_children: dict[tuple[str, str], Any] = {}
        self._latency_children: dict[str, Any] = {}

    def _error(self, exc: BaseException) -> ServiceError:
        """The client's error. An engine call that failed as if the engine were gone makes
        it suspect, and it is checked at once (engine_health.py): unhealthy for as long as it
        does not answer, not until the next background check. A cancelled request (its
        client went away) never comes here."""
        if isinstance(exc, EngineError) and exc.status == 503:
            self.engine_health.failed(str(exc))
        return _service_error(exc)

    def _count(self, rpc: str, status: str) -> None:
        key = (rpc, status)
        child = self._rpc_children.get(key)
        if child is None:
            child = self._rpc_children[key] = self.metrics.requests.labels(rpc, status)
        child.inc()

    def _enter(self) -> None:
        if self.state.draining:
            raise Draining("this proxy is draining; send the request elsewhere")
        if self.max_inflight and self._active >= self.max_inflight:
            # Back-pressure, not an outage: the engine queues up to the bound, and past it the
            # client is told to come back (a 429 the gateway answers with Retry-After).
            err = Overloaded(
                f"this replica holds {self._active} requests, its bound (--max-inflight "
                f"{self.max_inflight}); retry after {_OVERLOADED_RETRY_S}s",
                code="overloaded",
            )
            err.retry_after_s = _OVERLOADED_RETRY_S
            raise err
        self._active += 1
        self._idle.clear()
        self.metrics.inflight.inc()

    def _exit(self, rpc: str, started: float) -> None:
        self._active -= 1
        self.metrics.inflight.dec()
        child = self._latency_children.get(rpc)
        if child is None:
            child = self._latency_children[rpc] = self.metrics.latency.labels(rpc)
        child.observe(time.perf_counter() - started)
        if self._active == 0:
            self._idle.set()

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no generation RPC is running; False if the timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except TimeoutError:
            return False

    @property
    def active(self) -> int:
        return self._active

    def _deadline(self, request: envelope_pb2.OpenAIRequest, remaining: float | None) -> float:
        """Loop time by which the request must be done: the proxy's own timeout, the gRPC
        call's (`remaining`, None when it has none) and the envelope's, whichever is first."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + self.request_timeout
        if remaining is not None:
            deadline = min(deadline, now + remaining - DEADLINE_MARGIN_S)
        env_ms = request.envelope.deadline_unix_ms if request.HasField("envelope") else 0
        if env_ms:
            deadline = min(deadline, now + (env_ms / 1000.0 - time.time()))
        return deadline

    async def run_generation(
        self,
        rpc: str,
        request: envelope_pb2.OpenAIRequest,
        remaining: float | None,
        work: Callable[[], Awaitable[None]],
    ) -> ServiceError | None:
        """Run one generation request's `work` with the proxy's bookkeeping (draining, in-flight
        count, deadline, metrics, error mapping); the error to give the caller, if any.
        Cancellation (the caller went away) propagates."""
        started = time.perf_counter()
        try:
            self._enter()
        except ServiceError as e:
            self._count(rpc, str(e.http_status))
            return e
        err: ServiceError
        try:
            try:
                deadline = self._deadline(request, remaining)
                # A continuation on a peer (migration) is bounded by the same deadline.
                REQUEST_DEADLINE.set(deadline)
                async with asyncio.timeout_at(deadline):
                    with _request_span(rpc, request):
                        await work()
                self._count(rpc, "200")
                return None
            except asyncio.CancelledError:
                self._count(rpc, "499")
                raise
            except Exception as e:
                err = self._error(e)
        finally:
            self._exit(rpc, started)
        self._fail(rpc, request, err)
        return _in_own_words(err)

    def _fail(self, rpc: str, request: envelope_pb2.OpenAIRequest, err: ServiceError) -> None:
        self._count(rpc, str(err.http_status))
        if err.http_status >= 500:
            self.metrics.engine_errors.labels(err.code or "error").inc()
            log.warning(
                "%s request %s failed: %d %s",
                rpc,
                request.envelope.request_id or "-",
                err.http_status,
                err.message,
            )
        else:
            log.debug(
                "%s request %s rejected: %s", rpc, request.envelope.request_id or "-", err.message
            )


def _request_span(rpc: str, request: envelope_pb2.OpenAIRequest) -> Any:
    """One generation request as the proxy's SERVER span, child of the caller's context in
    the envelope (tracing.py)."""
    if not tracing.ON:
        return tracing.NOOP
    env = request.envelope
    return tracing.span(
        "proxy.request",
        kind=tracing.SERVER,
        parent=tracing.parent_from(env.trace_context),
        rpc=rpc,
        request_id=env.request_id,
        session_id=env.session_id,
        model=env.model,
        stream=env.stream,
    )
