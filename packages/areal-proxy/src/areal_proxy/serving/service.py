"""The inference proxy's gRPC services: InferenceProxyService (OpenAI chat/completions, whole
and streamed, RL sessions, generation control) and ProxyStatusService (GetStats). Deadlines,
cancellation, errors and metrics live here; what a request means lives in inference.py and
generation.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import orjson

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.common.records import Session
from areal_proxy.engine.base import EngineError
from areal_proxy.engine.peer import REQUEST_DEADLINE
from areal_proxy.generation.controller import GenerationController, GenerationRecord
from areal_proxy.generation.migration import MigrationFailed, continue_steps
from areal_proxy.inference import InferenceHandler
from areal_proxy.recording import export
from areal_proxy.recording.claims import ExportClaims
from areal_proxy.recording.selection import Policy, Summary
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.serving.metrics import ProxyMetrics
from areal_proxy.serving.multiplex import GenerateStream
from areal_proxy.serving.retirement import drain
from areal_runtime import tracing
from areal_runtime.errors import (
    Conflict,
    DeadlineExceeded,
    Draining,
    InternalError,
    InvalidRequest,
    Overloaded,
    PermissionDenied,
    ServiceError,
    Unauthenticated,
    abort,
    error_for,
)
from areal_runtime.session_keys import key_matches

if TYPE_CHECKING:
    from areal_proxy.serving.engine_health import EngineHealth

# Rows per ExportChunk: a large export streams as many JSONL chunks.
_CHUNK_ROWS = 256
# ... and about this many bytes at most (+ one row): 256 rows of a long session's turns
# (25 k tokens each) made a 50 MB chunk, over gRPC's message limit (the export failed 429).
_CHUNK_BYTES = 2 * 1024 * 1024

log = logging.getLogger(__name__)

# Our own deadline fires this much before the gRPC one, so the caller gets a 504 with an
# error detail (and the engine request is aborted) rather than a bare transport timeout.
_DEADLINE_MARGIN_S = 0.02
# How long GetStats waits for the engine's answer when it is not known healthy (less, when the
# poll's own deadline comes first): enough for an engine that answers, short enough that a
# poll of a replica whose engine hangs still gets its answer.
_VERDICT_WAIT_S = 1.0
# Retry-After of a request refused past --max-inflight: a generation on a busy CPU engine
# takes seconds, so sooner would mostly be refused again.
_OVERLOADED_RETRY_S = 2


@dataclass
class ProxyState:
    model: str
    engine_url: str
    proxy_id: str = ""
    engine_healthy: bool = False
    engine_detail: str = "engine not checked yet"
    # Healthy, but its last health check did not answer in time while it made progress
    # (engine/progress.py): it is working, not lost.
    engine_busy: bool = False
    draining: bool = False
    # Retired (graceful drain, retirement.py): its engine takes no work; it reports
    # `draining` so the router sends it only the turns of sessions pinned to it.
    retired: bool = False


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


class ProxyServicer(
    proxy_pb2_grpc.InferenceProxyServiceServicer, proxy_pb2_grpc.ProxyStatusServiceServicer
):
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
        self.claims = ExportClaims(book) if book is not None else None
        self.handler = handler
        self.controller = controller
        self.metrics = metrics
        self.state = state
        self.request_timeout = request_timeout
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._streams: set[GenerateStream] = set()
        self._streams_closed = False
        # Called once when this proxy retires (the server tells the router at once).
        self.on_retired: Callable[[], Awaitable[None]] | None = None
        self._rpc_children: dict[tuple[str, str], Any] = {}
        self._latency_children: dict[str, Any] = {}
        controller.on_finish = self._on_generation_finished
        metrics.stream_held_results.set_function(self.held_results)

    # ---- bookkeeping -------------------------------------------------------------------

    def _error(self, exc: BaseException) -> ServiceError:
        """The client's error. An engine call that failed as if the engine were gone makes
        it suspect, and it is checked at once (engine_health.py): unhealthy for as long as it
        does not answer, not until the next background check. A cancelled request (its
        client went away) never comes here."""
        if isinstance(exc, EngineError) and exc.status == 503:
            self.engine_health.failed(str(exc))
        return _service_error(exc)

    def _on_generation_finished(self, rec: GenerationRecord) -> None:
        ttft = rec.first_token_at - rec.created if rec.first_token_at is not None else None
        self.metrics.observe_generation(len(rec.prompt_ids), len(rec.token_ids), ttft, rec.attempts)

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
            deadline = min(deadline, now + remaining - _DEADLINE_MARGIN_S)
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

    async def _unary(
        self,
        rpc: str,
        request: envelope_pb2.OpenAIRequest,
        context: Any,
        fn: Callable[[bytes, Any], Awaitable[tuple[bytes, GenerationRecord]]],
    ) -> envelope_pb2.OpenAIResponse:
        out: list[bytes] = []

        async def work() -> None:
            body, _ = await fn(request.body, request.envelope)
            out.append(body)

        err = await self.run_generation(rpc, request, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)
        return envelope_pb2.OpenAIResponse(body=out[0])

    async def _stream(
        self,
        rpc: str,
        request: envelope_pb2.OpenAIRequest,
        context: Any,
        gen: Callable[[bytes, Any], AsyncGenerator[bytes, None]],
    ) -> None:
        async def work() -> None:
            async with aclosing(gen(request.body, request.envelope)) as chunks:
                async for data in chunks:
                    await context.write(envelope_pb2.StreamChunk(data=data))

        err = await self.run_generation(rpc, request, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)

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

    # ---- inference ---------------------------------------------------------------------

    async def ChatCompletion(self, request: Any, context: Any) -> envelope_pb2.OpenAIResponse:
        return await self._unary("ChatCompletion", request, context, self.handler.chat)

    async def ChatCompletionStream(self, request: Any, context: Any) -> None:  # type: ignore[override]
        await self._stream("ChatCompletionStream", request, context, self.handler.chat_stream)

    async def Completion(self, request: Any, context: Any) -> envelope_pb2.OpenAIResponse:
        return await self._unary("Completion", request, context, self.handler.completion)

    async def CompletionStream(self, request: Any, context: Any) -> None:  # type: ignore[override]
        await self._stream("CompletionStream", request, context, self.handler.completion_stream)

    async def Generate(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        stream = GenerateStream(self, context)
        self._streams.add(stream)
        if self._streams_closed:
            stream.close()
        try:
            await stream.run(request_iterator)
        finally:
            self._streams.discard(stream)

    async def CountTokens(self, request: Any, context: Any) -> proxy_pb2.CountTokensResponse:
        """A chat body's prompt size (inference/count.py): rendered and tokenized, nothing
        generated or recorded, so neither draining nor a paused engine holds it back."""
        try:
            n = await self.handler.count_tokens(request.body)
        except Exception as e:
            err = self._error(e)
            self._count("CountTokens", str(err.http_status))
            await abort(context, err)
            raise AssertionError("unreachable") from e
        self._count("CountTokens", "200")
        return proxy_pb2.CountTokensResponse(input_tokens=n)

    async def ContinueGeneration(self, request: Any, context: Any) -> None:  # type: ignore[override]
        """Another replica's request continued on this proxy's engine (migration.py)."""
        # The bookkeeping of every generation (draining refusal, deadline, metrics, errors)
        # reads an envelope: the call's id and deadline as one.
        env = envelope_pb2.OpenAIRequest(
            envelope=envelope_pb2.Envelope(
                request_id=request.rid,
                deadline_unix_ms=request.deadline_unix_ms,
                # The calling replica's engine span, from the call's metadata ({} when off).
                trace_context=tracing.metadata_carrier(context),
            )
        )

        async def work() -> None:
            steps = continue_steps(self.controller, request, self.state.proxy_id)
            async with aclosing(steps) as out:
                async for step in out:
                    await context.write(step)

        err = await self.run_generation("ContinueGeneration", env, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)

    def held_results(self) -> int:
        """Results every `Generate` stream holds for callers that gave no credit (the
        metrics thread calls this when it scrapes; `tuple()` copies the set in one step)."""
        return sum(stream.held() for stream in tuple(self._streams))

    def close_streams(self) -> None:
        """Shutdown: every `Generate` stream stops reading and ends once its requests are done
        (a caller resends what it wrote after that point elsewhere: it was never read)."""
        self._streams_closed = True
        for stream in list(self._streams):
            stream.close()

    # ---- control -----------------------------------------------------------------------

    def _control_response(self, message: str) -> proxy_pb2.ControlResponse:
        self.metrics.version.set(self.controller.version)
        self.metrics.paused.set(1 if self.controller.paused else 0)
        return proxy_pb2.ControlResponse(
            paused=self.controller.paused, version=self.controller.version, message=message
        )

    async def _control(
        self, rpc: str, context: Any, action: Callable[[], Awaitable[str]]
    ) -> proxy_pb2.ControlResponse:
        try:
            message = await action()
        except Exception as e:
            err = self._error(e)
            self._count(rpc, str(err.http_status))
            log.warning("%s failed: %s", rpc, err.message)
            await abort(context, err)
        self._count(rpc, "200")
        return self._control_response(message)

    async def Pause(self, request: Any, context: Any) -> proxy_pb2.ControlResponse:
        async def act() -> str:
            await self.controller.pause()
            return "generation paused"

        return await self._control("Pause", context, act)

    async def Continue(self, request: Any, context: Any) -> proxy_pb2.ControlResponse:
        async def act() -> str:
            await self.controller.resume()
            return "generation continued"

        return await self._control("Continue", context, act)

    async def SetVersion(self, request: Any, context: Any) -> proxy_pb2.ControlResponse:
        async def act() -> str:
            if request.version < 0:
                raise InvalidRequest("version must be >= 0", param="version")
            self.controller.set_version(int(request.version))
            return f"version set to {request.version}"

        return await self._control("SetVersion", context, act)

    async def UpdateWeights(self, request: Any, context: Any) -> proxy_pb2.ControlResponse:
        async def act() -> str:
            if not request.path:
                raise InvalidRequest("path is required", param="path")
            if request.version < -1:
                raise InvalidRequest("version must be >= 0, or -1 for current + 1", param="version")
            version = await self.controller.update_weights(request.path, int(request.version))
            return f"weights loaded from {request.path}; version {version}"

        return await self._control("UpdateWeights", context, act)

    async def Retire(self, request: Any, context: Any) -> proxy_pb2.RetireResponse:
        """Graceful drain of this replica (retirement.py); idempotent."""
        timeout = float(request.drain_timeout_s)
        try:
            if not timeout >= 0:  # NaN too
                raise InvalidRequest("drain_timeout_s must be >= 0", param="drain_timeout")
            if self.state.draining:
                raise Draining("this proxy is shutting down")
            if not self.state.retired:
                self.state.retired = True
                if self.on_retired is not None:
                    await self.on_retired()
            out = await drain(self.controller, timeout)
        except Exception as e:
            err = self._error(e)
            self._count("Retire", str(err.http_status))
            await abort(context, err)
            raise AssertionError("unreachable") from e
        self._count("Retire", "200")
        return proxy_pb2.RetireResponse(
            finished=out.finished, moved=out.moved, failed=out.failed, message=out.message
        )

    # ---- RL sessions -------------------------------------------------------------------

    def _sessions(self) -> SessionBook:
        if self.book is None:
            raise Conflict("this proxy records no sessions", code="no_recording")
        return self.book

    def _acting_on(
        self, env: Any, session_id: str, *, for_turn: bool, ended_ok: bool = False
    ) -> Session:
        """The session `env`'s key may act on: its own (session key) or any (admin key).
        `ended_ok`: an ended session too (a read); otherwise an ended one is a 409."""
        book = self._sessions()
        if env is not None and env.is_admin:
            found = book.store.session(session_id)
            if found is None:
                raise book.missing(session_id)
            return found
        key = env.api_key if env is not None else ""
        if not key or (env.session_id and env.session_id != session_id):
            raise PermissionDenied(
                "a session key may act only on its own session", code="forbidden_session"
            )
        if ended_ok:
            # SessionBook.authorize without its refusal of an ended session: the same 404
            # and 401.
            found = book.store.session(session_id)
            if found is None:
                raise book.missing(session_id)
            if not key_matches(key, found.key_hash):
                raise Unauthenticated("invalid session key", code="invalid_session_key")
            return found
        return book.authorize(session_id, key, for_turn=for_turn)

    async def _rpc(self, rpc: str, context: Any, action: Callable[[], Any]) -> Any:
        try:
            # Every session action reads or writes SQLite: on the recording thread.
            result = await self._sessions().call(action)
        except Exception as e:
            err = self._error(e)
            self._count(rpc, str(err.http_status))
            await abort(context, err)
            raise AssertionError("unreachable") from e
        self._count(rpc, "200")
        return result

    async def StartSessions(self, request: Any, context: Any) -> proxy_pb2.StartSessionsResponse:
        def act() -> proxy_pb2.StartSessionsResponse:
            if not request.group_id or not request.sessions:
                raise InvalidRequest("group_id and sessions are required", param="sessions")
            creds = [(c.session_id, c.session_api_key) for c in request.sessions]
            self._sessions().start(
                request.group_id, request.task_id, request.model or self.state.model, creds
            )
            return proxy_pb2.StartSessionsResponse(
                group_id=request.group_id, sessions=request.sessions
            )

        return await self._rpc("StartSessions", context, act)

    async def EndSessions(self, request: Any, context: Any) -> proxy_pb2.EndSessionsResponse:
        def act() -> proxy_pb2.EndSessionsResponse:
            env = request.envelope if request.HasField("envelope") else None
            for sid in request.session_ids:
                self._acting_on(env, sid, for_turn=False)
            return proxy_pb2.EndSessionsResponse(
                ended=self._sessions().end(list(request.session_ids), request.failure)
            )

        return await self._rpc("EndSessions", context, act)

    async def SetReward(self, request: Any, context: Any) -> proxy_pb2.SetRewardResponse:
        def act() -> proxy_pb2.SetRewardResponse:
            env = request.envelope if request.HasField("envelope") else None
            # Not for_turn: set_reward itself says what a closed session still accepts.
            session = self._acting_on(env, request.session_id, for_turn=False)
            iid = self._sessions().set_reward(session, request.interaction_id, request.reward)
            return proxy_pb2.SetRewardResponse(interaction_id=iid, reward=request.reward)

        return await self._rpc("SetReward", context, act)

    async def GetSession(self, request: Any, context: Any) -> proxy_pb2.GetSessionResponse:
        def act() -> proxy_pb2.GetSessionResponse:
            if not request.session_id:
                raise InvalidRequest("session_id is required", param="session_id")
            env = request.envelope if request.HasField("envelope") else None
            # A read: an ended session keeps its status (a trainer looks after it ended).
            session = self._acting_on(env, request.session_id, for_turn=False, ended_ok=True)
            status = self._sessions().status(session)
            return proxy_pb2.GetSessionResponse(status=orjson.dumps(status))

        return await self._rpc("GetSession", context, act)

    async def ExportTrajectories(self, request: Any, context: Any) -> None:  # type: ignore[override]
        try:
            book = self._sessions()
            env = request.envelope if request.HasField("envelope") else None

            summary = Summary(self.controller.version)
            policy = Policy(
                max_staleness=(
                    request.max_staleness if request.HasField("max_staleness") else None
                ),
                stale=request.stale or "drop",
                mask_stale_tokens=request.mask_stale_tokens,
                drop_incomplete_group=request.drop_incomplete_group,
                min_usable_group_size=request.min_usable_group_size,
            )

            def prepare() -> tuple[list[Session], Iterator[dict[str, Any]]]:
                if request.remove_session and not request.export_id:
                    raise InvalidRequest(
                        "remove_session needs an export_id: sessions are removed by "
                        "AckExport(export_id) once the client has the rows",
                        param="export_id",
                    )
                sessions = book.resolve_export(list(request.session_ids), request.group_id)
                if env is None or not env.is_admin:
                    for s in sessions:
                        self._acting_on(env, s.session_id, for_turn=False)
                # proto3 cannot tell 0.0 from unset: the gateway always sends the discount.
                style = request.style or export.DEFAULT_STYLE
                side_calls = request.side_calls or "include"
                rows = book.export_rows(
                    sessions,
                    style,
                    request.discount,
                    side_calls,
                    version=summary.version,
                    policy=policy,
                    summary=summary,
                )
                return sessions, rows

            def next_chunk(rows: Iterator[dict[str, Any]]) -> list[bytes]:
                out: list[bytes] = []
                size = 0
                for r in itertools.islice(rows, _CHUNK_ROWS):
                    out.append(orjson.dumps(r) + b"\n")
                    size += len(out[-1])
                    if size >= _CHUNK_BYTES:
                        break
                return out

            # Reading the rows, building and serializing them: on the recording thread, one
            # chunk at a time (other recording work runs between chunks), never on the loop.
            sessions, rows = await book.call(prepare)
            while batch := await book.call(next_chunk, rows):
                await context.write(proxy_pb2.ExportChunk(jsonl=b"".join(batch), rows=len(batch)))
            # Every row is read: the summary is whole. Last, in a chunk of its own.
            await context.write(proxy_pb2.ExportChunk(summary=orjson.dumps(summary.to_json())))
            self.metrics.observe_export(
                summary.staleness,
                summary.outcomes(),
                summary.dropped_groups,
                summary.masked_tokens,
            )
            # Removal only when asked, and never here: the rows are only handed to gRPC, and
            # the client may still not get them (another proxy of the export fails, the
            # gateway or the client goes away). The sessions are claimed under the export's
            # id; AckExport, sent once the client has everything, removes them
            # (recording/claims.py). Either way the retention of these sessions starts
            # (--retention-seconds once ended too).
            if request.remove_session:
                assert self.claims is not None
                await book.call(self.claims.claim, request.export_id, sessions)
            await book.call(book.exported, sessions)
        except Exception as e:
            err = self._error(e)
            self._count("ExportTrajectories", str(err.http_status))
            await abort(context, err)
            return
        self._count("ExportTrajectories", "200")

    async def AckExport(self, request: Any, context: Any) -> proxy_pb2.AckExportResponse:
        def act() -> proxy_pb2.AckExportResponse:
            if not request.export_id:
                raise InvalidRequest("export_id is required", param="export_id")
            claims = self.claims
            assert claims is not None  # _rpc refused a proxy without a book already
            env = request.envelope if request.HasField("envelope") else None
            if env is not None and env.is_admin:
                out = claims.ack(request.export_id)
            else:
                # A session key removes only its own session, and only with its key.
                sid = env.session_id if env is not None else ""
                key = env.api_key if env is not None else ""
                if not sid or not key:
                    raise PermissionDenied(
                        "a session key may acknowledge only its own session's export",
                        code="forbidden_session",
                    )
                out = claims.ack(request.export_id, session_id=sid, api_key=key)
            return proxy_pb2.AckExportResponse(
                removed_session_ids=out.removed,
                kept_session_ids=out.kept,
                emptied_group_ids=out.emptied_groups,
            )

        return await self._rpc("AckExport", context, act)

    async def GetStats(self, request: Any, context: Any) -> proxy_pb2.ProxyStats:
        st = self.state
        if not st.engine_healthy:
            # The router asks again when a pinned session's request waits on the answer:
            # what the engine says now, not at the last check (engine_health.py).
            remaining = context.time_remaining()
            within = _VERDICT_WAIT_S
            if remaining is not None:
                within = min(within, remaining - 5 * _DEADLINE_MARGIN_S)
            await self.engine_health.verdict(within)
        if st.draining:
            detail = "draining"
        elif st.retired:
            detail = "retired: generating on other replicas for the sessions pinned here"
        else:
            detail = "" if st.engine_healthy else st.engine_detail
        return proxy_pb2.ProxyStats(
            healthy=st.engine_healthy,
            draining=st.draining or st.retired,
            retired=st.retired,
            paused=self.controller.paused,
            version=self.controller.version,
            inflight_requests=len(self.controller.inflight),
            inflight_tokens=self.controller.inflight_tokens,
            # Kept in memory by the book: a stats poll reads no SQLite and answers at once.
            sessions=self.book.live_sessions if self.book is not None else 0,
            model=st.model,
            engine_url=st.engine_url,
            detail=detail,
            total_requests=self.controller.total_requests,
            tool_call_parser=self.handler.config.tool_call_parser,
            reasoning_parser=self.handler.config.reasoning_parser,
            default_tool_prompt=self.handler.default_tool_prompt,
        )


def add_to_server(servicer: ProxyServicer, server: grpc.aio.Server) -> None:
    """Register what an inference proxy serves; agent-mode RPCs are not registered at all."""
    proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server(servicer, server)
    proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(servicer, server)


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
