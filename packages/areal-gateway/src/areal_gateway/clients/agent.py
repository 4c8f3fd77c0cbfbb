"""An agent proxy's RPCs (AgentProxyService: sessions, turns, rewards, export and its ack)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from areal_gateway.clients.common import (
    ensure_connected,
    open_channel,
    proxy_error,
    read_messages,
)
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.auth import call_metadata

log = logging.getLogger(__name__)


# Metadata naming the session key a non-admin caller presented, on the agent RPCs whose
# request carries no envelope (close, history): the proxy checks it against the session's hash.
SESSION_KEY_METADATA = "x-areal-session-key"


class AgentProxyClient:
    """The agent-mode RPCs of one data proxy (sessions, turns, rewards, export)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, md: Sequence[tuple[str, str]]):
        self.address = address
        self._channel = channel
        self._stub = proxy_pb2_grpc.AgentProxyServiceStub(channel)
        self._md = tuple(md)

    def _keyed(self, session_key: str) -> tuple[tuple[str, str], ...]:
        return (*self._md, (SESSION_KEY_METADATA, session_key)) if session_key else self._md

    async def _unary(
        self, method: Any, request: Any, timeout_s: float | None, md: Sequence[tuple[str, str]]
    ) -> Any:
        # The request leaves with the call: "unreachable" is decided before sending it.
        await ensure_connected(self._channel, self.address, min(timeout_s or 3600.0, 5.0))
        call = method(request, timeout=timeout_s, metadata=md)
        try:
            return await call
        except grpc.RpcError as exc:
            raise proxy_error(exc, self.address, started=True) from None
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def create_session(
        self, session_id: str, session_key: str, metadata: bytes, timeout_s: float | None = 60.0
    ) -> proxy_pb2.CreateAgentSessionResponse:
        req = proxy_pb2.CreateAgentSessionRequest(
            session_id=session_id, session_api_key=session_key, metadata=metadata
        )
        return await self._unary(self._stub.CreateAgentSession, req, timeout_s, self._md)

    async def close_session(
        self, session_id: str, session_key: str = "", timeout_s: float | None = 30.0
    ) -> bool:
        """`session_key` empty: the caller is the admin."""
        req = proxy_pb2.CloseAgentSessionRequest(session_id=session_id)
        resp = await self._unary(
            self._stub.CloseAgentSession, req, timeout_s, self._keyed(session_key)
        )
        return bool(resp.existed)

    async def history(
        self, session_id: str, session_key: str = "", timeout_s: float | None = 30.0
    ) -> bytes:
        req = proxy_pb2.GetAgentHistoryRequest(session_id=session_id)
        resp = await self._unary(
            self._stub.GetAgentHistory, req, timeout_s, self._keyed(session_key)
        )
        return bytes(resp.history)

    async def set_reward(
        self, request: proxy_pb2.SetRewardRequest, timeout_s: float | None = 60.0
    ) -> proxy_pb2.SetRewardResponse:
        return await self._unary(self._stub.SetAgentReward, request, timeout_s, self._md)

    async def turn(
        self, request: proxy_pb2.AgentTurnRequest, timeout_s: float | None
    ) -> AsyncIterator[tuple[str, bytes]]:
        """(event type, JSON data) as the agent emits them; a failure is a `ServiceError`."""
        await ensure_connected(self._channel, self.address, min(timeout_s or 3600.0, 5.0))
        call = self._stub.AgentTurn(request, timeout=timeout_s, metadata=self._md)
        async for msg in read_messages(call, self.address):
            yield msg.type, bytes(msg.data)

    async def export(
        self, request: proxy_pb2.ExportTrajectoriesRequest, timeout_s: float | None
    ) -> list[proxy_pb2.ExportChunk]:
        """The exported rows as JSON-lines chunks (one per session), each with removal naming
        the export_id that `ack_export` removes them with."""
        call = self._stub.ExportAgentTrajectories(request, timeout=timeout_s, metadata=self._md)
        return [msg async for msg in read_messages(call, self.address)]

    async def ack_export(
        self, request: proxy_pb2.AckAgentExportRequest, timeout_s: float | None = 60.0
    ) -> proxy_pb2.AckExportResponse:
        return await self._unary(self._stub.AckAgentExport, request, timeout_s, self._md)


class AgentProxyPool:
    """One `AgentProxyClient` (one channel) per agent proxy address, reused."""

    def __init__(self, token: str) -> None:
        self._md = call_metadata(token)
        self._clients: dict[str, AgentProxyClient] = {}

    def get(self, address: str) -> AgentProxyClient:
        client = self._clients.get(address)
        if client is None:
            client = AgentProxyClient(address, open_channel(address), self._md)
            self._clients[address] = client
        return client

    async def close(self, grace: float | None = None) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c._channel.close(grace) for c in clients), return_exceptions=True)
