"""The generation endpoints without the framework's per-request layers.

`POST /v1/chat/completions` and `POST /v1/completions` (and their aliases) are the hot path.
Through FastAPI each request passes some ten ASGI layers (error middleware, telemetry, body
limit, exception handlers, exit stack, router, request/response wrapper), each wrapping
`send` once more. `GenerationFastPath` sits in front of the app and runs these requests'
endpoint directly, with the same answers: the same handler (`openai.forward.handle`), the
same OpenAI-shaped errors (a 413 closes the connection, anything unexpected is a logged 500),
and the same request metrics as `MetricsMiddleware`. Every other request, every other method
on these paths, lifespan, and agent mode go to the app unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from areal_gateway.auth import bearer_key
from areal_gateway.metrics import endpoint_label
from areal_gateway.openai.chat import CHAT, check_chat
from areal_gateway.openai.completions import COMPLETIONS, check_completion
from areal_gateway.openai.errors import bad_request, error_body
from areal_gateway.openai.forward import (
    Endpoint,
    GenerationResponse,
    _too_large,
    choose_request_id,
    parse_model_and_stream,
    parse_object,
)
from areal_gateway.runtime import Gateway
from areal_runtime.errors import ServiceError

log = logging.getLogger(__name__)

_ENDPOINTS: dict[str, tuple[Endpoint, Any]] = {
    "/v1/chat/completions": (CHAT, check_chat),
    "/chat/completions": (CHAT, check_chat),
    "/v1/completions": (COMPLETIONS, check_completion),
    "/completions": (COMPLETIONS, check_completion),
}


class GenerationFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        state = getattr(app, "state", None)
        gw: Gateway | None = getattr(state, "gateway", None) if state is not None else None
        self.gateway = gw
        self.enabled = gw is not None and gw.settings.mode == "inference"
        self._children: dict[str, tuple[Any, Any]] = {}
        self._status: dict[tuple[str, int], Any] = {}

    # Same series as MetricsMiddleware (one child lookup per label, then cached).
    def _metrics(self, label: str) -> tuple[Any, Any]:
        children = self._children.get(label)
        if children is None:
            assert self.gateway is not None
            m = self.gateway.metrics
            children = self._children[label] = (m.inflight.labels(label), m.latency.labels(label))
        return children

    def _count(self, label: str, status: int) -> None:
        key = (label, status)
        child = self._status.get(key)
        if child is None:
            assert self.gateway is not None
            child = self._status[key] = self.gateway.metrics.requests.labels(label, str(status))
        child.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.enabled and scope["type"] == "http" and scope["method"] == "POST":
            found = _ENDPOINTS.get(scope["path"])
            if found is not None:
                await self._generate(found[0], found[1], scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _generate(
        self, endpoint: Endpoint, check: Any, scope: Scope, receive: Receive, send: Send
    ) -> None:
        label = endpoint_label(scope["path"])
        inflight, latency = self._metrics(label)
        status = 500
        started = False
        start = time.perf_counter()

        async def send_counted(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        inflight.inc()
        try:
            try:
                response = await self._prepare(endpoint, check, scope, receive)
            except ServiceError as err:
                headers = [(b"content-type", b"application/json")]
                if err.http_status == 413:
                    headers.append((b"connection", b"close"))
                await _whole(send_counted, err.http_status, headers, error_body(err))
                return
            await response(scope, receive, send_counted)
        except Exception as exc:
            log.error("unhandled error on POST %s: %r", scope["path"], exc, exc_info=exc)
            if started:
                raise
            internal = ServiceError(
                500, "Internal error in the gateway.", type="api_error", code="internal_error"
            )
            await _whole(
                send_counted, 500, [(b"content-type", b"application/json")], error_body(internal)
            )
        finally:
            inflight.dec()
            latency.observe(time.perf_counter() - start)
            self._count(label, status)

    async def _prepare(
        self, endpoint: Endpoint, check: Any, scope: Scope, receive: Receive
    ) -> GenerationResponse:
        """`openai.forward.handle`, reading the three headers it needs straight off the scope
        (the first occurrence of each, as Starlette's `Headers.get`)."""
        gw = self.gateway
        assert gw is not None
        auth = length = rid = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if auth is None:
                    auth = value.decode("latin-1")
            elif name == b"content-length":
                if length is None:
                    length = value.decode("latin-1")
            elif name == b"x-request-id" and rid is None:
                rid = value.decode("latin-1")
        principal = gw.auth.authenticate(bearer_key(auth))
        body = await _read_body(receive, length, gw.settings.max_body_bytes)
        doc = parse_object(body)
        model, stream = parse_model_and_stream(doc)
        check(doc)
        return GenerationResponse(
            gw, endpoint, principal, choose_request_id(rid), model, stream, body, doc
        )


async def _read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """`openai.forward.read_body` on the raw ASGI messages."""
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
            raise ServiceError(499, "Client closed the request.", code="client_closed")
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


async def _whole(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
