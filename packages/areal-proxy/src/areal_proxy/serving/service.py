"""The inference proxy's gRPC services: InferenceProxyService (OpenAI chat/completions, whole
and streamed, RL sessions, generation control) and ProxyStatusService (GetStats), one object
composed of its RPC groups: generation (generate_rpcs.py), RL sessions (session_rpcs.py),
control and stats (control_rpcs.py), over what they share (rpc_base.py). What a request means
lives in inference/ and generation/."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from areal_proto.proxy.v1 import proxy_pb2_grpc
from areal_proxy.generation.controller import GenerationController
from areal_proxy.inference import InferenceHandler
from areal_proxy.recording.claims import ExportClaims
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.serving.control_rpcs import ControlRpcs
from areal_proxy.serving.generate_rpcs import GenerateRpcs
from areal_proxy.serving.metrics import ProxyMetrics
from areal_proxy.serving.session_rpcs import SessionRpcs
from areal_proxy.serving.state import ProxyState

if TYPE_CHECKING:
    from areal_proxy.serving.engine_health import EngineHealth


class ProxyServicer(GenerateRpcs, SessionRpcs, ControlRpcs):
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
        on_retired: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            handler=handler,
            controller=controller,
            metrics=metrics,
            state=state,
            engine_health=engine_health,
            request_timeout=request_timeout,
            book=book,
            max_inflight=max_inflight,
        )
        self.claims = ExportClaims(book) if book is not None else None
        self._streams = set()
        self._streams_closed = False
        self.on_retired = on_retired


def add_to_server(servicer: ProxyServicer, server: grpc.aio.Server) -> None:
    """Register what an inference proxy serves; agent-mode RPCs are not registered at all."""
    proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server(servicer, server)
    proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(servicer, server)
