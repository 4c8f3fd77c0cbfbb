"""What every client module shares: channel options, error mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from areal_runtime.errors import (
    ERROR_METADATA_KEY,
    ServiceError,
    Unavailable,
    UpstreamError,
    from_rpc_error,
)

# Seconds for router calls (routing, registry): these are cheap and never generate.
ROUTER_TIMEOUT = 10.0

# A restarted replica at the same address must be reachable again quickly: gRPC's default
# reconnect back-off grows to 120 s.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)

# What grpc reports when it could not open a connection to the target at all.
_CONNECT_FAILURE_MARKERS = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "dns resolution failed",
)


class ProxyUnreachable(Unavailable):
    """The proxy could not be reached: the call never started there, so it may go elsewhere.
    The gateway's own finding, never sent over gRPC (a client sees a plain `Unavailable`)."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(f"proxy {address} is unreachable: {detail}", code="proxy_unreachable")
        self.address = address


def _has_detail(exc: grpc.RpcError) -> bool:
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in trailing or ())


def _is_connect_failure(exc: grpc.RpcError) -> bool:
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = (exc.details() or "").lower() if hasattr(exc, "details") else ""
    return any(marker in details for marker in _CONNECT_FAILURE_MARKERS)


def proxy_error(exc: grpc.RpcError, address: str, *, started: bool) -> ServiceError:
    """Map a failed proxy call: its own OpenAI error passes through; a transport failure is a
    bad gateway (502), except that a refused connection before anything arrived is
    `ProxyUnreachable` (retryable on another replica)."""
    if _has_detail(exc):
        return from_rpc_error(exc, target="proxy")
    if not started and _is_connect_failure(exc):
        return ProxyUnreachable(address, exc.details() or "connection failed")
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAVAILABLE:
        return UpstreamError(f"proxy {address} failed: {exc.details() or 'unavailable'}")
    return from_rpc_error(exc, target=f"proxy {address}")


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def read_messages(call: Any, address: str, *, started: bool = False) -> AsyncIterator[Any]:
    """The messages of a server-streaming proxy call. A failure is a `ServiceError` (one before
    the first message may be `ProxyUnreachable` unless `started`); when the consumer stops
    early (its client went away) the call is cancelled, so the proxy sees it."""
    try:
        while True:
            try:
                msg = await call.read()
            except grpc.RpcError as exc:
                raise proxy_error(exc, address, started=started) from None
            if msg is grpc.aio.EOF:
                return
            started = True
            yield msg
    finally:
        if not call.done():
            call.cancel()
