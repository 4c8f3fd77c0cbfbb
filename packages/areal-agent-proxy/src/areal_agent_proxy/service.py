"""The agent proxy's gRPC services: AgentProxyService (sessions and ordered turns in front of
one agent worker) and ProxyStatusService (GetStats)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson

from areal_agent_proxy.inference_link import InferenceLink
from areal_agent_proxy.metrics import AgentProxyMetrics
from areal_agent_proxy.sessions import AgentSession, AgentSessions
from areal_agent_proxy.worker_client import WorkerClient
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.errors import (
    Conflict,
    Draining,
    InvalidRequest,
    ServiceError,
    SessionNotFound,
    abort,
)
from areal_runtime.session_keys import new_id

log = logging.getLogger("areal_agent_proxy")

# The session key a non-admin caller presented, on calls without an envelope (close,
# history); absent = the gateway acts for the admin. The internal token authenticates the
# gateway itself.
SESSION_KEY_METADATA = "x-areal-session-key"


def _caller(context: grpc.aio.ServicerContext) -> tuple[str, bool]:
    """(key, is_admin) for `AgentSessions.get`."""
    for k, v in context.invocation_metadata() or ():
        if k == SESSION_KEY_METADATA:
            return (v if isinstance(v, str) else v.decode()), False
    return "", True


class AgentModeServicer(
    proxy_pb2_grpc.AgentProxyServiceServicer, proxy_pb2_grpc.ProxyStatusServiceServicer
):
    def __init__(
        self,
        worker: WorkerClient,
        sessions: AgentSessions,
        *,
        link: InferenceLink | None = None,
        proxy_id: str = "",
        turn_timeout: float | None = None,
        metrics: AgentProxyMetrics | None = None,
    ) -> None:
        self.worker = worker
        self.sessions = sessions
        self.link = link
        self.proxy_id = proxy_id
        self.turn_timeout = turn_timeout
        self.running_turns = 0
        self.total_turns = 0
        self.worker_healthy = False
        self.draining = False
        self.metrics = metrics or AgentProxyMetrics()
        # Read when /metrics is scraped.
        self.metrics.running.set_function(lambda: self.running_turns)
        self.metrics.sessions.set_function(lambda: len(self.sessions))
        self.metrics.worker_healthy.set_function(lambda: float(self.worker_healthy))

    # -- background ---------------------------------------------------------

    async def watch(self, interval: float = 1.0) -> None:
        """Track worker health and close idle sessions, until cancelled."""
        while True:
            self.worker_healthy = await self.worker.healthy(rpc_timeout=min(interval, 1.0))
            for s in self.sessions.idle():
                idle = self.sessions.timeout_of(s)
                log.info("session %s idle for %.0fs: closing", s.session_id, idle)
                await self._close(s)
            await asyncio.sleep(interval)

    async def _close(self, s: AgentSession) -> None:
        self.sessions.pop(s.session_id)
        with contextlib.suppress(ServiceError):
            await self.worker.close_session(s.session_id)
        if self.link is not None and s.rl_key:
            with contextlib.suppress(ServiceError):
                await self.link.end_session(s.rl_key)

    async def _create(self, session_id: str, key: str, metadata: dict[str, Any]) -> AgentSession:
        s = self.sessions.create(session_id, key, metadata)
        if self.link is not None:
            try:
                s.rl_session_id, s.rl_key = await self.link.start_session(task_id=session_id)
            except ServiceError:
                self.sessions.pop(session_id)
                raise
        return s

    # -- sessions -----------------------------------------------------------

    async def CreateAgentSession(
        self, request: proxy_pb2.CreateAgentSessionRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.CreateAgentSessionResponse:
        try:
            meta = orjson.loads(request.metadata) if request.metadata else {}
            s = await self._create(
                request.session_id or new_id("agent"), request.session_api_key, meta
            )
        except ServiceError as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e
        return proxy_pb2.CreateAgentSessionResponse(
            session_id=s.session_id, rl_session_id=s.rl_session_id
        )

    async def AgentTurn(
        self, request: proxy_pb2.AgentTurnRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proxy_pb2.AgentEventMessage]:
        env = request.envelope
        started = time.monotonic()
        try:
            if self.draining:
                raise Draining("this agent pair is draining")
            s = self.sessions.get(request.session_id, env.api_key, is_admin=env.is_admin)
            if s is None:
                if not env.is_admin:
                    raise SessionNotFound(f"session '{request.session_id}' not found")
                s = await self._create(request.session_id or new_id("agent"), "", {})
        except ServiceError as e:
            self.metrics.observe_turn("error", time.monotonic() - started, e.code or "")
            await abort(context, e)
            return
        message = orjson.loads(request.message) if request.message else ""
        metadata = orjson.loads(request.metadata) if request.metadata else {}
        # ok | error | cancelled (areal_agent_proxy.metrics.TURN_OUTCOMES); None until known.
        outcome: str | None = None
        code = ""
        try:
            async with s.lock:
                self.running_turns += 1
                self.total_turns += 1
                parts: list[str] = []
                failed = False
                link = (
                    (self.link.base_url, s.rl_key, self.link.model)
                    if self.link and s.rl_key
                    else None
                )
                try:
                    async for typ, data in self.worker.run_turn(
                        session_id=s.session_id,
                        message=message,
                        history=list(s.history),
                        metadata={**s.metadata, **metadata},
                        run_id=env.request_id or new_id("run"),
                        link=link,
                        rpc_timeout=self.turn_timeout,
                    ):
                        if typ == "delta":
                            parts.append(str(data.get("text", "")))
                        elif typ == "error":
                            # Known before the event goes out: a caller that stops reading
                            # after it (the gateway, non-stream) does not make it "cancelled".
                            failed = True
                            outcome, code = "error", "agent_error"
                        yield proxy_pb2.AgentEventMessage(type=typ, data=orjson.dumps(data))
                    outcome = outcome or "ok"
                except ServiceError as e:
                    outcome, code = "error", e.code or ""
                    await abort(context, e)
                finally:
                    self.running_turns -= 1
                    s.last_active_at = time.time()
                if not failed:
                    s.history.append({"role": "user", "content": message})
                    s.history.append({"role": "assistant", "content": "".join(parts)})
                    s.turns += 1
        finally:
            # Neither ok nor failed: the caller went away (the stream was cancelled).
            self.metrics.observe_turn(outcome or "cancelled", time.monotonic() - started, code)

    async def CloseAgentSession(
        self, request: proxy_pb2.CloseAgentSessionRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.CloseAgentSessionResponse:
        try:
            key, admin = _caller(context)
            s = self.sessions.get(request.session_id, key, is_admin=admin)
        except ServiceError as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e
        if s is not None:
            await self._close(s)
        return proxy_pb2.CloseAgentSessionResponse(existed=s is not None)

    async def GetAgentHistory(
        self, request: proxy_pb2.GetAgentHistoryRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.GetAgentHistoryResponse:
        try:
            key, admin = _caller(context)
            s = self.sessions.get(request.session_id, key, is_admin=admin)
        except ServiceError as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e
        if s is None:
            await abort(
                context,
                SessionNotFound(f"session '{request.session_id}' not found"),
            )
            raise AssertionError("unreachable")
        return proxy_pb2.GetAgentHistoryResponse(history=orjson.dumps(s.history))

    # -- rewards and export through the linked inference service -------------

    def _linked(self, session_id: str, env: Any) -> tuple[AgentSession, InferenceLink]:
        s = self.sessions.get(session_id, env.api_key, is_admin=env.is_admin)
        if s is None:
            raise SessionNotFound(f"session '{session_id}' not found")
        if self.link is None or not s.rl_key:
            raise Conflict(
                "this agent service is not linked to an inference service", code="not_linked"
            )
        return s, self.link

    async def SetAgentReward(
        self, request: proxy_pb2.SetRewardRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.SetRewardResponse:
        try:
            s, link = self._linked(request.session_id, request.envelope)
            out = await link.set_reward(s.rl_key, request.reward, request.interaction_id)
        except ServiceError as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e
        return proxy_pb2.SetRewardResponse(
            interaction_id=out.get("interaction_id", ""), reward=request.reward
        )

    async def ExportAgentTrajectories(
        self, request: proxy_pb2.ExportTrajectoriesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proxy_pb2.ExportChunk]:
        for sid in request.session_ids:
            try:
                s, link = self._linked(sid, request.envelope)
                # proto3 cannot tell 0.0 from unset: the gateway always sends the discount
                # (as for the inference proxy's ExportTrajectories), so 0.0 means 0.0.
                # With removal nothing is removed yet: the chunk names the inference export's
                # id, and the gateway's client acknowledges it (AckAgentExport) once it has
                # the rows; acknowledging here lost them whenever they did not get there.
                rows, export_id = await link.export(
                    s.rl_session_id,
                    request.style or "concat",
                    request.discount,
                    request.remove_session,
                    request.side_calls or "include",
                )
            except ServiceError as e:
                await abort(context, e)
                return
            for row in rows:
                row["agent_session_id"] = sid
            yield proxy_pb2.ExportChunk(
                jsonl=b"".join(orjson.dumps(r) + b"\n" for r in rows),
                rows=len(rows),
                export_id=export_id,
            )

    async def AckAgentExport(
        self, request: proxy_pb2.AckAgentExportRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.AckExportResponse:
        try:
            if not request.export_id:
                raise InvalidRequest("export_id is required", param="export_id")
            s, link = self._linked(request.session_id, request.envelope)
            out = await link.ack_export(s.rl_key, request.export_id)
        except ServiceError as e:
            await abort(context, e)
            raise AssertionError("unreachable") from e
        # In agent session ids: the one RL session is this agent session's.
        return proxy_pb2.AckExportResponse(
            removed_session_ids=[s.session_id] if s.rl_session_id in out.removed else [],
            kept_session_ids=[s.session_id] if s.rl_session_id in out.kept else [],
        )

    # -- health and load ----------------------------------------------------

    async def GetStats(
        self, request: proxy_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> proxy_pb2.ProxyStats:
        return proxy_pb2.ProxyStats(
            healthy=self.worker_healthy,
            draining=self.draining,
            inflight_requests=self.running_turns,
            sessions=len(self.sessions),
            total_requests=self.total_turns,
            detail=""
            if self.worker_healthy
            else f"agent worker at {self.worker.address} not serving",
        )


def add_to_server(servicer: AgentModeServicer, server: grpc.aio.Server) -> None:
    """Register what an agent proxy serves; inference RPCs are not registered at all."""
    proxy_pb2_grpc.add_AgentProxyServiceServicer_to_server(servicer, server)
    proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(servicer, server)
