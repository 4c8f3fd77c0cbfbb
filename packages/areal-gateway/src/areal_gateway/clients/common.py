"""What every client module shares: channel options, error mapping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from areal_gateway.clients.redact import public, redact
from areal_runtime import tls
from areal_runtime.errors import (
    ERROR_METADATA_KEY,
    ServiceError,
    Unavailable,
    UpstreamError,
    from_rpc_error,
)

log = logging.getLogger(__name__)

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

# Seconds a per-call request (--no-proxy-streams) waits for a connection to its proxy before
# the proxy counts as unreachable (the request is then routed again: nothing was sent).
CONNECT_TIMEOUT = 5.0


class ProxyUnreachable(Unavailable):
    """The proxy could not be reached: the call never started there, so it may go elsewhere.
    The gateway's own finding, never sent over gRPC (a client sees a plain `Unavailable`)."""

    def __init__(self, address: str, detail: str) -> None:
        # The address is for the log and the retry, never for the client's message.
        super().__init__(
            f"A replica of the model could not be reached ({redact(detail)}); retry the request.",
            code="proxy_unreachable",
        )
        self.address = address


def _has_detail(exc: grpc.RpcError) -> bool:
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in trailing or ())


def proxy_error(exc: grpc.RpcError, address: str, *, started: bool) -> ServiceError:
    """Map a failed proxy call: its own OpenAI error passes through; a refused internal token
    is `InternalAuthFailed` (502); a transport failure is a bad gateway (502), except that
    one before anything was sent (`started` False: the stream never opened) is
    `ProxyUnreachable`, retryable on another replica.

    The decision is the caller's knowledge of what it sent, plus the status code: never
    grpc's wording of the failure, which differs between versions and transports. Its
    message names no internal address (redact.py); the log keeps it."""
    source = f"proxy {address}"
    if _has_detail(exc):
        return public(from_rpc_error(exc, target="proxy"), source)
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAVAILABLE:
        details = exc.details() or "unavailable"
        if not started:
            log.warning("%s unreachable: %s", source, details)
            return ProxyUnreachable(address, "connection failed")
        log.warning("%s failed mid-request: %s", source, details)
        return UpstreamError(
            "The model's replica failed during the request (its connection was lost); retry "
            "the request."
        )
    return public(from_rpc_error(exc, target="proxy"), source)


async def ensure_connected(
    channel: grpc.aio.Channel, address: str, timeout_s: float = CONNECT_TIMEOUT
) -> None:
    """Return once `channel` has a connection (READY), else raise `ProxyUnreachable`.

    For a call that carries its request as it starts (unary, server-streaming): once sent,
    a failure may come after the proxy began generating, and generation is never retried.
    So the one case that may go elsewhere is decided before sending, from the channel's
    state: a connection attempt that failed (TRANSIENT_FAILURE) or none within `timeout_s`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        ):
            raise ProxyUnreachable(address, f"no connection ({state.name.lower()})")
        left = deadline - loop.time()
        if left <= 0:
            raise ProxyUnreachable(address, f"no connection within {timeout_s:g} s")
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), left)
        except TimeoutError:
            raise ProxyUnreachable(address, f"no connection within {timeout_s:g} s") from None
        state = channel.get_state(try_to_connect=True)


def open_channel(address: str, options: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.Channel:
    """A channel with CHANNEL_OPTIONS; `options` override those of the same name."""
    names = {name for name, _ in options}
    return tls.channel(
        address, options=[*(o for o in CHANNEL_OPTIONS if o[0] not in names), *options]
    )


async def read_messages(call: Any, address: str) -> AsyncIterator[Any]:
    """The messages of a server-streaming proxy call, whose request left with the call: a
    failure is a `ServiceError`, never `ProxyUnreachable` (`ensure_connected` decides that
    before the call). When the consumer stops early (its client went away) the call is
    cancelled, so the proxy sees it."""
    try:
        while True:
            try:
                msg = await call.read()
            except grpc.RpcError as exc:
                raise proxy_error(exc, address, started=True) from None
            if msg is grpc.aio.EOF:
                return
            yield msg
    finally:
        if not call.done():
            call.cancel()
