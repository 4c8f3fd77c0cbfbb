"""The control RPCs: the trainer's control of generation (`Pause`, `Continue`, `SetVersion`,
`UpdateWeights`), the operator's `Retire` (retirement.py), and `ProxyStatusService.GetStats`,
what the router polls."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.serving.retirement import drain
from areal_proxy.serving.rpc_base import DEADLINE_MARGIN_S, ServicerBase
from areal_runtime.errors import Draining, InvalidRequest, abort

log = logging.getLogger(__name__)

# How long GetStats waits for the engine's answer when it is not known healthy (less, when the
# poll's own deadline comes first): enough for an engine that answers, short enough that a
# poll of a replica whose engine hangs still gets its answer.
_VERDICT_WAIT_S = 1.0


class ControlRpcs(
    ServicerBase,
    proxy_pb2_grpc.InferenceProxyServiceServicer,
    proxy_pb2_grpc.ProxyStatusServiceServicer,
):
    # Called once when this proxy retires (the server tells the router at once).
    on_retired: Callable[[], Awaitable[None]] | None

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

    async def GetStats(self, request: Any, context: Any) -> proxy_pb2.ProxyStats:
        st = self.state
        if not st.engine_healthy:
            # The router asks again when a pinned session's request waits on the answer:
            # what the engine says now, not at the last check (engine_health.py).
            remaining = context.time_remaining()
            within = _VERDICT_WAIT_S
            if remaining is not None:
                within = min(within, remaining - 5 * DEADLINE_MARGIN_S)
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
