"""One engine's HTTP connection and what a failed call over it tells about its request.

`EngineTransport` is what the SGLang and vLLM clients share: the pooled session with its
timeouts and headers, the health probe, the probes of a JSON endpoint, the control POST with
its retries and error mapping, the generation POST that waits out a busy engine's accept
queue, and close. Each client keeps only what is its engine's: the request body, the reading
of the answer, which status is a refusal, and its control endpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from yarl import URL

from areal_proxy.engine.base import EngineError
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

# How long a health or information probe may take for an answer.
PROBE_TIMEOUT_S = 5.0

# The connection broke under a request (server disconnected, reset, or the body cut short):
# the engine went away, it did not answer about the request.
LOST = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)


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


def stream_unfinished(emitted: int) -> EngineError:
    """The engine closed a stream without finishing the request: it went away."""
    return EngineError(
        f"engine stream ended without a finish reason after {emitted} tokens",
        status=502,
        lost=True,
    )


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's answer to a control call, whatever its status."""

    status: int
    body: bytes
    content_type: str


class EngineTransport:
    """One engine replica's HTTP session and the calls every engine client makes over it."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        api_key: str = "",
        connect_timeout: float = CONNECT_TIMEOUT_S,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        # Health and information probes: an answer within `probe_timeout` or none.
        self.probe_timeout = aiohttp.ClientTimeout(
            total=probe_timeout, sock_connect=min(connect_timeout, probe_timeout)
        )
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    def url(self, path: str) -> URL:
        """The engine's `path`, parsed once by the caller that keeps it (aiohttp would parse
        a string on every request)."""
        return URL(self.base_url + path)

    def http(self) -> aiohttp.ClientSession:
        """The pooled session, opened on first use (inside the event loop)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                json_serialize=lambda o: orjson.dumps(o).decode(),
                trace_configs=trace_configs(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def unreachable(self, e: Exception) -> EngineError:
        """A connection that could not be made: nothing was sent, so it may go elsewhere."""
        return EngineError(
            f"engine unreachable at {self.base_url}: {e}",
            status=503,
            retryable=True,
            lost=True,
        )

    async def health(self) -> bool | None:
        return await probe_health(self.http(), self.base_url + "/health", self.probe_timeout)

    async def probe_json(self, path: str) -> Any:
        """GET `path` within the probe timeout: its JSON, None for a status other than 200.
        EngineError (503): no answer, or one that is not JSON."""
        try:
            async with self.http().get(self.base_url + path, timeout=self.probe_timeout) as r:
                if r.status != 200:
                    return None
                return orjson.loads(await r.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
            raise EngineError(f"engine {path} failed: {e!r}", status=503) from e

    async def get_json(self, path: str) -> Any:
        """GET `path` under the session's own timeout, its body read as JSON."""
        try:
            async with self.http().get(self.base_url + path) as r:
                return orjson.loads(await r.read())
        except aiohttp.ClientError as e:
            raise EngineError(f"engine unreachable at {self.base_url}: {e}", status=503) from e

    async def control(
        self, path: str, body: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> Answer:
        """POST a control call (pause, resume, weights, flush, abort) and read its answer,
        made again while its connection cannot be made. EngineError: unreachable (503) or
        the call broke (502); an error status is the caller's to judge."""
        try:
            return await retry_unconnected(lambda: self._control_once(path, body, params))
        except NOT_CONNECTED as e:
            raise self.unreachable(e) from e

    async def _control_once(
        self, path: str, body: dict[str, Any] | None, params: dict[str, str] | None
    ) -> Answer:
        try:
            async with self.http().post(
                self.base_url + path, data=orjson.dumps(body or {}), params=params
            ) as r:
                raw = await r.read()
                return Answer(r.status, raw, r.headers.get("Content-Type", ""))
        except NOT_CONNECTED:
            raise
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"engine {path} failed: {e!r}", status=502) from e

    async def post(self, url: URL, payload: bytes) -> aiohttp.ClientResponse:
        """Send a generation request and wait for its response headers, patient with a busy
        engine's accept queue (`patient_connect`). aiohttp errors propagate: what they mean
        for the request is the client's to say (a refused connection: `unreachable`)."""
        http = self.http()
        return await patient_connect(lambda: http.post(url, data=payload))
