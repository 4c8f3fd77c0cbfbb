"""The AgentWorkerService: one user agent, one turn per RunTurn call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from areal_agent_worker.contract import AgentEvent, AgentRequest, Emitter, InferenceLink
from areal_proto.agent.v1 import agent_worker_pb2, agent_worker_pb2_grpc

log = logging.getLogger("areal_agent_worker")


class WorkerMetrics:
    def __init__(self) -> None:
        self.prom = CollectorRegistry()
        self.turns = Counter(
            "areal_agent_turns_total", "Turns by outcome", ["outcome"], registry=self.prom
        )
        self.running = Gauge("areal_agent_turns_running", "Turns in progress", registry=self.prom)
        self.latency = Histogram("areal_agent_turn_seconds", "Turn duration", registry=self.prom)
        self.first_event = Histogram(
            "areal_agent_first_event_seconds", "Time to the agent's first event", registry=self.prom
        )


def _json(raw: bytes, default: Any) -> Any:
    return orjson.loads(raw) if raw else default


class AgentWorkerServicer(agent_worker_pb2_grpc.AgentWorkerServiceServicer):
    def __init__(self, agent: Any, metrics: WorkerMetrics) -> None:
        self.agent = agent
        self.metrics = metrics
        self.running: set[asyncio.Task[None]] = set()

    async def RunTurn(
        self, request: agent_worker_pb2.RunTurnRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_worker_pb2.AgentEvent]:
        link = request.inference
        req = AgentRequest(
            message=_json(request.message, ""),
            session_id=request.session_id,
            history=_json(request.history, []),
            metadata=_json(request.metadata, {}),
            run_id=request.run_id,
            inference=InferenceLink(link.base_url, link.api_key, link.model)
            if link.base_url
            else None,
        )
        emitter = Emitter()
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = asyncio.create_task(self._run(req, emitter))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        self.metrics.running.inc()
        first = True
        try:
            while True:
                ev = await emitter._queue.get()
                if ev is None:
                    break
                if first:
                    self.metrics.first_event.observe(loop.time() - started)
                    first = False
                yield agent_worker_pb2.AgentEvent(type=ev.type, data=orjson.dumps(ev.data))
        finally:
            # The caller went away (or the turn ended): never leave the turn running.
            if not task.done():
                task.cancel()
                self.metrics.turns.labels("cancelled").inc()
            self.metrics.running.dec()
            self.metrics.latency.observe(loop.time() - started)

    async def _run(self, req: AgentRequest, emitter: Emitter) -> None:
        q = emitter._queue
        try:
            result = await self.agent.run(req, emitter=emitter)
            if isinstance(result, str) and result and not emitter.emitted_text:
                await emitter.delta(result)
            await q.put(AgentEvent("done", {"text": result if isinstance(result, str) else None}))
            self.metrics.turns.labels("ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # The session survives an agent error: the turn ends with an error event.
            log.exception("agent raised in session %s", req.session_id)
            self.metrics.turns.labels("error").inc()
            await q.put(
                AgentEvent(
                    "error",
                    {"message": f"agent error: {type(e).__name__}: {e}", "type": "agent_error"},
                )
            )
        finally:
            q.put_nowait(None)

    async def CloseSession(
        self, request: agent_worker_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> agent_worker_pb2.CloseSessionResponse:
        hook = getattr(self.agent, "close_session", None)
        if hook is not None:
            try:
                await hook(request.session_id)
            except Exception:
                log.exception("close_session hook failed for %s", request.session_id)
        return agent_worker_pb2.CloseSessionResponse()
