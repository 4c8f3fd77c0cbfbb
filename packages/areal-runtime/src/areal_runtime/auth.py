"""The internal token every internal gRPC call carries (docs/services.md)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_ENV = "AREAL_INTERNAL_TOKEN"
TOKEN_METADATA_KEY = "x-areal-internal-token"
_EXEMPT_PREFIX = "/grpc.health.v1."


def internal_token() -> str:
    return os.environ.get(TOKEN_ENV, "")


def call_metadata(token: str | None = None) -> tuple[tuple[str, str], ...]:
    token = internal_token() if token is None else token
    return ((TOKEN_METADATA_KEY, token),) if token else ()


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the service's internal token (health is exempt)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")
            yield  # pragma: no cover - makes this an async generator

        async def deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")
            yield  # pragma: no cover - makes this an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)
        # A denial must have the method's shape: a unary-request handler on a streaming
        # method would wait for a request message the caller may never send.
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny_bidi)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self._token or details.method.startswith(_EXEMPT_PREFIX):
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._token):
                    return await continuation(details)
                break
        handler = await continuation(details)
        if handler is not None and handler.request_streaming:
            return self._deny_bidi
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    token = internal_token()
    return [InternalTokenInterceptor(token)] if token else []
