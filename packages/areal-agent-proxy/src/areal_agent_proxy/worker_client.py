"""The only module that touches the agent worker's gRPC stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson

from areal_proto.agent.v1 import agent_worker_pb2, agent_worker_pb2_grpc
from areal_runtime import tls
from areal_runtime.auth import call_metadata
from areal_runtime.errors import Unavailable, from_rpc_error


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = tls.channel(address)
        self._stub = agent_worker_pb2_grpc.AgentWorkerServiceStub(self._channel)
        self._md = call_metadata()

    async def close(self) -> None:
        await self._channel.close()

    async def run_turn(
        self,
        *,
        session_id: str,
        message: Any,
        history: list[dict[str, Any]],
        metadata: dict[str, Any],
        run_id: str,
        link: tuple[str, str, str] | None,
        rpc_timeout: float | None = None,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        req = agent_worker_pb2.RunTurnRequest(
            session_id=session_id,
            message=orjson.dumps(message),
            history=orjson.dumps(history),
            metadata=orjson.dumps(metadata),
            run_id=run_id,
        )
        if link is not None:
            req.inference.base_url, req.inference.api_key, req.inference.model = link
        call = self._stub.RunTurn(req, metadata=self._md, timeout=rpc_timeout)
        try:
            async for ev in call:
                yield ev.type, orjson.loads(ev.data) if ev.data else {}
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e, target="agent worker")
            if isinstance(err, Unavailable):
                err = Unavailable(
                    f"agent worker at {self.address} is unavailable", code="worker_unavailable"
                )
            raise err from None
        finally:
            call.cancel()

    async def close_session(self, session_id: str) -> None:
        try:
            await self._stub.CloseSession(
                agent_worker_pb2.CloseSessionRequest(session_id=session_id),
                metadata=self._md,
                timeout=10,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, target="agent worker") from None

    async def healthy(self, rpc_timeout: float = 1.0) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=rpc_timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING
