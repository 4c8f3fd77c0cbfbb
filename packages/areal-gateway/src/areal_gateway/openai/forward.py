"""The generation path shared by chat and completions, as `fastpath.GenerationFastPath` runs it:

    auth -> read body (size-capped) -> parse what the gateway acts on -> GenerationResponse

`GenerationResponse` is an ASGI response that does the rest while watching for the client
to go away: Route on the router -> the proxy's unary or streaming call on a reused channel
(or the external model over the shared HTTP client). A client disconnect cancels the work,
which cancels the gRPC call, which the proxy sees. Generation is never retried; only a proxy
that refused the connection (the call never reached it) sends the request to a new Route.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from areal_gateway.auth import Principal
from areal_gateway.clients import (
    GenerationRequest,
    ProxyClient,
    ProxyUnreachable,
    generation_request,
)
from areal_gateway.metrics import note_client_gone, note_model
from areal_gateway.openai.errors import bad_request, error_body
from areal_gateway.openai.sse import DONE, SSE_HEADERS, error_frame, frames
from areal_gateway.prefix import prefix_hashes
from areal_gateway.runtime import Gateway
from areal_proto.common.v1 import envelope_pb2
from areal_proto.router.v1 import router_pb2
from areal_runtime import tracing
from areal_runtime.bodycost import INLINE_NS, parses_inline, too_complex
from areal_runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    Draining,
    InternalError,
    NoHealthyReplica,
    PayloadTooLarge,
    PermissionDenied,
    ServiceError,
    UpstreamError,
)
from areal_runtime.openai import load_body, read_head

log = logging.getLogger(__name__)

# New routes after a proxy refused the connection (the call never reached it).
MAX_ROUTE_RETRIES = 2

# What a session's request is to its trajectory, when the client says: "side" (a title, a
# summary: recorded, and marked side in the export) or "main" (trained). Absent: the proxy's
# export decides (docs/services.md, "Chains and side calls").
CALL_HEADER = b"x-areal-call"
CALL_KINDS = ("side", "main")

_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class Endpoint:
    label: str  # metrics label: "chat" or "completions"
    external_path: str  # path under an external model's base_url
    # (client, request, timeout)
    unary: Callable[[ProxyClient, GenerationRequest, float | None], Any]
    # Batches of stream chunks: the chunks in one batch arrived together.
    stream: Callable[[ProxyClient, GenerationRequest, float | None], AsyncIterator[list[bytes]]]


# --- reading and parsing -------------------------------------------------------------------


def call_kind(value: str | None) -> str:
    """The `x-areal-call` header's value as the envelope carries it ("" when absent)."""
    if value is None:
        return ""
    kind = value.strip().lower()
    if kind not in CALL_KINDS:
        raise bad_request(
            f"Header 'x-areal-call' must be 'side' or 'main' (or left out), got {value[:40]!r}.",
            code="invalid_value",
            param="x-areal-call",
        )
    return kind


def _too_large(limit: int) -> ServiceError:
    return PayloadTooLarge(f"Request body is larger than {limit} bytes.")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of a Starlette request, refusing more than `limit` bytes."""
    return await receive_body(request.receive, request.headers.get("content-length"), limit)


async def receive_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole body off the raw ASGI messages, refusing more than `limit` bytes (declared
    in Content-Length or actually sent). The one body reader: the generation fast path has
    no Request object, every other endpoint reaches it through `read_body`."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request(
                "Invalid Content-Length header.", code="invalid_content_length"
            ) from None
        if size > limit:
            raise _too_large(limit)
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                total += len(chunk)
                if total > limit:
                    raise _too_large(limit)
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise Cancelled("Client closed the request.")
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


def parse_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the protocol's 400 (areal_runtime.openai)."""
    return load_body(body)


def parse_bounded(body: bytes, limit_ns: int = INLINE_NS) -> dict[str, Any]:
    """`parse_object` on this loop for a body that is never screened (control, RL and agent
    endpoints): one with more structure than `limit_ns` is refused first (413
    `body_too_complex`, areal_runtime.bodycost). Control bodies are small by nature: the
    default is what the loop may spend on one body."""
    if not parses_inline(body):
        refused = too_complex(body, limit_ns)
        if refused is not None:
            raise refused
    return load_body(body)


def parse_model_and_stream(doc: dict[str, Any]) -> tuple[str, bool]:
    head = read_head(doc)
    return head.model, head.stream


def request_id(request: Request) -> str:
    return choose_request_id(request.headers.get("x-request-id"))


def choose_request_id(given: str | None) -> str:
    """The caller's X-Request-Id when it is a sane one, else a fresh id."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return os.urandom(12).hex()


# --- the response -----------------------------------------------------------------------------


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class GenerationResponse(Response):
    """Routes and forwards one generation request as the ASGI response itself.

    A `Response` only so that FastAPI passes it through untouched; it writes its own status,
    headers and body (the status is known only once the proxy answered).
    """

    background = None

    def __init__(
        self,
        gw: Gateway,
        endpoint: Endpoint,
        principal: Principal,
        request_id: str,
        model: str,
        stream: bool,
        body: bytes,
        doc: dict[str, Any] | None,
        prefix: list[int] | None = None,
    ) -> None:
        self.gw = gw
        self.endpoint = endpoint
        self.principal = principal
        self.request_id = request_id
        self.model = model
        self.stream = stream
        self.raw_body = body
        # The size of the body the client sent (raw_body is a translation's, for Messages
        # and Responses): what a session's next body is compared with (fastpath.py).
        self.client_body_bytes = len(body)
        # None when a screen read the body (openai/screen.py): parsed here only if needed.
        self.doc = doc
        self.prefix = prefix
        self.start = time.monotonic()
        timeout = gw.settings.request_timeout
        self.deadline = self.start + timeout
        self.deadline_unix_ms = int((time.time() + timeout) * 1000)
        self._headers_sent = False
        self._span: tracing.Span = tracing.NOOP
        # Headers every answer of this request carries besides the standard ones (an API's
        # `x-areal-left-out`: left_out.py).
        self.extra_headers: list[tuple[bytes, bytes]] = []
        # The `x-areal-call` header ("side", "main" or ""), for the proxy's recording.
        self.call_kind = ""

    def document(self) -> dict[str, Any]:
        if self.doc is None:
            self.doc = parse_object(self.raw_body)
        return self.doc

    def _prefix(self) -> list[int]:
        return self.prefix if self.prefix is not None else prefix_hashes(self.document())

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("The request timed out.")
        return left

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The work runs in this task; a watcher cancels it if the client goes away (which
        # cancels the gRPC call, which the proxy sees).
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await _wait_disconnect(receive)
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            with tracing.span(
                "gateway.request",
                kind=tracing.SERVER,
                parent=tracing.parent_from_headers(scope["headers"]),
                endpoint=self.endpoint.label,
                model=self.model,
                session_id=self.principal.session_id,
                request_id=self.request_id,
                stream=self.stream,
            ) as self._span:
                await self._run(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            note_client_gone(scope)
            self.gw.metrics.disconnects.labels(self.endpoint.label).inc()
            log.info("request %s: client disconnected, generation cancelled", self.request_id)
        finally:
            watcher.cancel()
            # At the end: by now the catalog has been asked about this model (a first request
            # to a new gateway is not counted "unknown" for a snapshot not fetched yet).
            note_model(scope, self.gw.catalog.model_label(self.model))

    # -- sending --
    async def _send_error(self, send: Send, err: ServiceError) -> None:
        self.gw.metrics.errors.labels(str(err.http_status), err.code or "").inc()
        if self._headers_sent:
            await send({"type": "http.response.body", "body": self._stream_failed(err)})
            return
        self._say_retry_after(err)
        await self._send_whole(send, err.http_status, error_body(err))

    def _say_retry_after(self, err: ServiceError) -> None:
        """An error that says when to come back (a replica's back-pressure, 429
        `overloaded`) answers it as `Retry-After`."""
        if err.retry_after_s:
            self.extra_headers = [
                *self.extra_headers,
                (b"retry-after", str(int(err.retry_after_s)).encode()),
            ]

    # -- what the client gets: chat and completions as the proxy answered (the Responses
    # endpoint overrides these four to translate; responses/endpoint.py) --
    def _result(self, body: bytes) -> bytes:
        """The body for a whole answer."""
        return body

    def _stream_frames(self, batch: list[bytes]) -> bytes:
        """The events for stream chunks that arrived together."""
        return frames(batch)

    def _stream_done(self) -> bytes:
        return DONE

    def _stream_failed(self, err: ServiceError) -> bytes:
        """The last bytes of a stream that failed after its headers went out."""
        return error_frame(err) + DONE

    async def _finishing(self) -> None:
        """Runs once the answer is complete and before its last bytes are sent (the
        Responses endpoint stores the response there, so a client that has its answer can
        continue it at once, through any gateway)."""

    async def _send_whole(self, send: Send, status: int, body: bytes) -> None:
        self._headers_sent = True
        self._span.set(status=status)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *_JSON_HEADERS,
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", self.request_id.encode()),
                    *self.extra_headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _start_stream(self, send: Send, status: int = 200) -> None:
        self._headers_sent = True
        self._span.set(status=status)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    *SSE_HEADERS,
                    (b"x-request-id", self.request_id.encode()),
                    *self.extra_headers,
                ],
            }
        )

    # -- the work --
    def _request(self) -> GenerationRequest:
        p = self.principal
        envelope = envelope_pb2.Envelope(
            request_id=self.request_id,
            api_key=p.api_key,
            model=self.model,
            stream=self.stream,
            deadline_unix_ms=self.deadline_unix_ms,
            session_id=p.session_id,
            is_admin=p.is_admin,
            # The proxy's spans join the gateway's proxy call (tracing.py): {} when off.
            trace_context=tracing.carrier(),
            call_kind=self.call_kind,
        )
        return generation_request(envelope, self.raw_body)

    async def _run(self, send: Send) -> None:
        try:
            external = self.gw.catalog.external(self.model)
            if external is not None:
                await self._external(send, external)
                return
            await self._internal(send)
        except ServiceError as err:
            if err.http_status >= 500:
                log.warning("request %s (%s): %s", self.request_id, self.model, err.message)
            await self._send_error(send, err)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request %s: unexpected error", self.request_id)
            await self._send_error(
                send,
                InternalError(f"Internal error in the gateway ({type(exc).__name__})."),
            )

    async def _internal(self, send: Send) -> None:
        gw = self.gw
        routes = gw.routes
        retries = 0
        while True:
            with tracing.span(
                "gateway.route", model=self.model, session_id=self.principal.session_id
            ) as found:
                route = await routes.route(
                    self.model,
                    session_id=self.principal.session_id,
                    timeout_s=min(self.remaining(), 10.0),
                    prefix=self._prefix,
                )
                found.set(proxy_id=route.proxy_id)
            if route.model.kind == router_pb2.MODEL_KIND_EXTERNAL:
                await self._external(send, route.model)
                return
            if not route.address:
                raise NoHealthyReplica(f"No healthy replica for model {self.model!r}.")
            gw.metrics.routed_to(self.model, route.proxy_id).inc()
            client = gw.proxies.get(route.address)
            routes.acquire(route.address)
            try:
                with tracing.span(
                    "gateway.proxy",
                    kind=tracing.CLIENT,
                    model=self.model,
                    session_id=self.principal.session_id,
                    proxy_id=route.proxy_id,
                    attempt=retries,
                ):
                    await self._call_proxy(send, client)
                return
            except ServiceError as err:
                # Nothing ran there: the proxy was unreachable, closed its stream unread, or is
                # draining (which a request outside a session, free to go anywhere, need not
                # hear about). The router decides again (no lease); another replica may take it.
                unread = isinstance(err, ProxyUnreachable) or (
                    isinstance(err, Draining) and not self.principal.session_id
                )
                if not unread:
                    raise
                routes.invalidate(self.model)
                if retries >= MAX_ROUTE_RETRIES or self._headers_sent:
                    raise
                retries += 1
                gw.metrics.retries.inc()
                log.warning(
                    "request %s: %s; routing again (%d/%d)",
                    self.request_id,
                    err.message,
                    retries,
                    MAX_ROUTE_RETRIES,
                )
            finally:
                routes.release(route.address)

    async def _call_proxy(self, send: Send, client: ProxyClient) -> None:
        # Made here, inside the call's span, whose context the envelope carries.
        request = self._request()
        if self.stream:
            await self._stream_from(send, self.endpoint.stream(client, request, self.remaining()))
        else:
            body = self._result(await self.endpoint.unary(client, request, self.remaining()))
            await self._finishing()
            await self._send_whole(send, 200, body)

    async def _stream_from(self, send: Send, batches: AsyncIterator[list[bytes]]) -> None:
        metrics = self.gw.metrics
        counter = metrics.chunks_of(self.endpoint.label)
        try:
            try:
                first = await batches.__anext__()
            except StopAsyncIteration:
                await self._start_stream(send)
                done = self._stream_done()
                await self._finishing()
                await send({"type": "http.response.body", "body": done})
                return
            # Errors before this point are plain HTTP errors with their status.
            metrics.first_chunk.labels(self.endpoint.label).observe(time.monotonic() - self.start)
            await self._start_stream(send)
            # Chunks that arrived together leave in one write; none waits for another.
            await send(
                {
                    "type": "http.response.body",
                    "body": self._stream_frames(first),
                    "more_body": True,
                }
            )
            counter.inc(len(first))
            try:
                async for batch in batches:
                    await send(
                        {
                            "type": "http.response.body",
                            "body": self._stream_frames(batch),
                            "more_body": True,
                        }
                    )
                    counter.inc(len(batch))
            except ServiceError as err:
                log.warning("request %s: stream failed: %s", self.request_id, err.message)
                await self._send_error(send, err)
                return
            done = self._stream_done()
            await self._finishing()
            await send({"type": "http.response.body", "body": done})
        finally:
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _external(self, send: Send, model: router_pb2.ModelInfo) -> None:
        if not self.principal.is_admin:
            raise PermissionDenied(
                f"Model {self.model!r} is an external model; only the admin key may use it.",
                code="external_model_forbidden",
            )
        fwd = self.gw.external
        resp = await fwd.send(model, self.endpoint.external_path, self.document(), self.remaining())
        self.gw.metrics.external.labels(str(resp.status_code)).inc()
        ctype = resp.headers.get("content-type", "")
        if not self.stream or resp.status_code != 200 or "text/event-stream" not in ctype:
            body = await fwd.read(resp, model.name)
            await self._send_upstream_whole(send, resp.status_code, body, ctype)
            return
        await self._start_stream(send)
        chunks = fwd.iter_bytes(resp, model.name)
        try:
            async for chunk in chunks:
                out = self._external_bytes(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except ServiceError as err:
            await self._send_error(send, err)
            return
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await resp.aclose()
        done = self._external_done()
        await self._finishing()
        await send({"type": "http.response.body", "body": done})

    def _external_bytes(self, chunk: bytes) -> bytes:
        """What the client gets for bytes of an external model's event stream: the same."""
        return chunk

    def _external_done(self) -> bytes:
        return b""

    async def _send_upstream_whole(self, send: Send, status: int, body: bytes, ctype: str) -> None:
        if status < 400 or _is_openai_error(body):
            if status < 300:
                body = self._result(body)
                await self._finishing()
            self._headers_sent = True
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (b"content-type", (ctype or "application/json").encode("latin-1")),
                        (b"x-request-id", self.request_id.encode()),
                        *self.extra_headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        raise UpstreamError(f"External model {self.model!r} answered {status}.")


def _is_openai_error(body: bytes) -> bool:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict)
