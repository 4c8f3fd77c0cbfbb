"""What a failed HTTP call to an engine tells about the request it carried."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import aiohttp

from areal_runtime import tracing
from areal_runtime.sse import SSEReader

_T = TypeVar("_T")

# How long a connection to an engine may take to open (aiohttp's `sock_connect`).
CONNECT_TIMEOUT_S = 5.0

# The connection was never made (refused, or not answered within `sock_connect`), so no byte
# of the request reached the engine: it may be sent again, or elsewhere. aiohttp raises a
# connect timeout as `ConnectionTimeoutError`, which is not a `ClientConnectorError`.
NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)

# Tries of a control call (pause, resume, weights, flush, abort) whose connection could not be
# made, and the wait before the n-th retry (n x this). A CPU engine generating on every core
# has left a loopback connect unanswered for 5 s (CI, vLLM, a pause beside a long stream);
# failing the trainer's pause on that is worse than trying again.
CONTROL_ATTEMPTS = 3
CONTROL_RETRY_WAIT_S = 0.2


async def probe_health(
    session: aiohttp.ClientSession, url: str, within: aiohttp.ClientTimeout
) -> bool | None:
    """An engine's health endpoint: True 200, False a refused connection or any other answer
    (an error status, a connection reset), None no answer within `within` (busy or hung: the
    proxy tells which by the engine's progress, engine/progress.py)."""
    try:
        async with session.get(url, timeout=within) as r:
            return r.status == 200
    except aiohttp.ClientConnectorError:
        return False
    except TimeoutError:  # aiohttp's connect and read timeouts are TimeoutErrors too
        return None
    except aiohttp.ClientError:
        return False


def trace_configs() -> list[aiohttp.TraceConfig]:
    """An engine session's `trace_configs`: each HTTP request to the engine carries the
    current span as `traceparent` (tracing.py). None while tracing is off, so aiohttp does
    no per-request work for it."""
    if not tracing.ON:
        return []
    config = aiohttp.TraceConfig()
    config.on_request_start.append(_inject_trace)
    return [config]


async def _inject_trace(
    session: aiohttp.ClientSession, ctx: object, params: aiohttp.TraceRequestStartParams
) -> None:
    tracing.inject_into(params.headers)


async def patient_connect(call: Callable[[], Awaitable[_T]]) -> _T:
    """`call()` (a generation's request), made again while its connection is not answered
    within `sock_connect` (a busy engine's full accept queue), CONTROL_ATTEMPTS times in all.
    Nothing of the request reached the engine, and the engine is busy, not gone: the request
    waits for it rather than moving to another replica (migration is for a lost engine, and
    on a model's only replica there is none). A refused connection is not retried here."""
    for attempt in range(1, CONTROL_ATTEMPTS):
        try:
            return await call()
        except aiohttp.ConnectionTimeoutError:
            await asyncio.sleep(CONTROL_RETRY_WAIT_S * attempt)
    return await call()


async def retry_unconnected(call: Callable[[], Awaitable[_T]]) -> _T:
    """`call()`, made again while its connection cannot be made, CONTROL_ATTEMPTS times in
    all; the last try's NOT_CONNECTED propagates."""
    for attempt in range(1, CONTROL_ATTEMPTS):
        try:
            return await call()
        except NOT_CONNECTED:
            await asyncio.sleep(CONTROL_RETRY_WAIT_S * attempt)
    return await call()


async def sse_batches(content: aiohttp.StreamReader) -> AsyncIterator[list[bytes]]:
    """The `data:` payloads of an engine's SSE body: every event one read of the response
    buffer completes, at once, whatever their length.

    Under load (or behind a slow client) several events wait in the buffer; read together
    they cost one wake-up of the request's task, not one each. aiohttp's line iterator
    refuses a line over its buffer limit (512 KiB here), and an engine may send one: SGLang's
    cumulative mode holds the whole output so far in every event.
    """
    reader = SSEReader()
    async for data in content.iter_any():
        if events := reader.feed(data):
            yield events
    if rest := reader.close():
        yield rest


async def sse_payloads(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The same payloads one at a time, for a client that handles each event by itself."""
    async for events in sse_batches(content):
        for data in events:
            yield data
