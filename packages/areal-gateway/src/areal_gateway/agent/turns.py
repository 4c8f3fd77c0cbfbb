"""`POST /v1/responses` and `POST /v1/chat/completions` in agent mode: one agent turn each.

    auth -> which session (key, metadata.session_id, previous_response_id, or a new one)
         -> Route (the session's pair) -> the proxy's AgentTurn stream -> a shape

Streaming writes each agent event as it arrives; headers go out with the first event, so a
failure before it (dead pair: 503, unknown session: 404, wrong key: 403) is a plain HTTP error.
An agent `error` event is a 500 `agent_error` (non-stream) or a final error event (stream);
the session survives it. A client that goes away cancels the turn (and the agent's `run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from areal_gateway.agent.common import (
    IMPLICIT_SESSION_TTL_S,
    SESSION_HEADER,
    check_session_access,
    create_session,
    gateway,
    log,
    metadata_of,
    normalize_content,
    principal,
    proxy_of,
    release,
    store_flag,
    stream_flag,
)
from areal_gateway.agent.shapes import ChatShape, ResponsesShape, agent_error, session_of_response
from areal_gateway.auth import Principal
from areal_gateway.metrics import note_client_gone, note_model
from areal_gateway.openai.errors import bad_request, error_body
from areal_gateway.openai.forward import parse_bounded, read_body, request_id
from areal_gateway.openai.sse import SSE_HEADERS
from areal_gateway.runtime import Gateway
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.bodycost import MAX_STRUCTURE_NS
from areal_runtime.errors import InternalError, ServiceError, SessionNotFound

_JSON = (b"content-type", b"application/json")
# Sessions made for one admin chat request are closed after it (kept alive by this set).
_closing: set[asyncio.Task[None]] = set()


class Shape(Protocol):
    def start(self) -> bytes: ...
    def event(self, typ: str, data: dict[str, Any]) -> bytes: ...
    def finish(self) -> bytes: ...
    def fail(self, err: ServiceError) -> bytes: ...
    def whole(self) -> bytes: ...


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


class TurnResponse(Response):
    """Runs one agent turn as the ASGI response itself (status known only once it started)."""

    background = None

    def __init__(
        self,
        gw: Gateway,
        p: Principal,
        rid: str,
        session_id: str,
        message: Any,
        metadata: dict[str, Any],
        stream: bool,
        shape: Shape,
        model: str,
        ephemeral: bool = False,
    ) -> None:
        self.gw = gw
        self.p = p
        self.rid = rid
        self.session_id = session_id
        self.message = message
        self.metadata = metadata
        self.stream = stream
        self.shape = shape
        self.model = model
        self.ephemeral = ephemeral
        self.timeout = gw.settings.request_timeout
        self._headers_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        note_model(scope, self.gw.catalog.model_label(self.model))
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            try:
                done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                work.cancel()
                watch.cancel()
                raise
            if work in done:
                watch.cancel()
                work.result()
                return
            work.cancel()
            note_client_gone(scope)
            log.info("turn %s (session %s): client gone, turn cancelled", self.rid, self.session_id)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
        finally:
            if self.ephemeral:
                task = asyncio.ensure_future(_close_quietly(self.gw, self.session_id))
                _closing.add(task)
                task.add_done_callback(_closing.discard)

    def _head(self, content_type: tuple[bytes, bytes] | None) -> list[tuple[bytes, bytes]]:
        base = [content_type] if content_type else list(SSE_HEADERS)
        return [
            *base,
            (b"x-request-id", self.rid.encode()),
            (SESSION_HEADER.encode(), self.session_id.encode()),
        ]

    async def _whole(self, send: Send, status: int, body: bytes) -> None:
        self._headers_sent = True
        await send({"type": "http.response.start", "status": status, "headers": self._head(_JSON)})
        await send({"type": "http.response.body", "body": body})

    async def _write(self, send: Send, body: bytes, more: bool = True) -> None:
        if body or not more:
            await send({"type": "http.response.body", "body": body, "more_body": more})

    def _request(self) -> proxy_pb2.AgentTurnRequest:
        p = self.p
        return proxy_pb2.AgentTurnRequest(
            envelope=envelope_pb2.Envelope(
                request_id=self.rid,
                api_key=p.api_key,
                model=self.model,
                stream=self.stream,
                deadline_unix_ms=int((time.time() + self.timeout) * 1000),
                session_id=self.session_id,
                is_admin=p.is_admin,
            ),
            session_id=self.session_id,
            message=orjson.dumps(self.message),
            metadata=orjson.dumps(self.metadata),
        )

    async def _run(self, send: Send) -> None:
        try:
            client = await proxy_of(self.gw, self.session_id)
            events = client.turn(self._request(), self.timeout)
            try:
                if self.stream:
                    await self._streamed(send, events)
                else:
                    await self._collected(send, events)
            finally:
                await events.aclose()  # type: ignore[attr-defined]
        except ServiceError as err:
            if isinstance(err, SessionNotFound):
                await release(self.gw, self.session_id)  # no pin left for a gone session
            if err.http_status >= 500:
                log.warning("turn %s (session %s): %s", self.rid, self.session_id, err.message)
            await self._error(send, err)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("turn %s: unexpected error", self.rid)
            await self._error(
                send,
                InternalError(f"Internal error in the gateway ({type(exc).__name__})."),
            )

    async def _error(self, send: Send, err: ServiceError) -> None:
        self.gw.metrics.errors.labels(str(err.http_status), err.code or "").inc()
        if self._headers_sent:
            await self._write(send, self.shape.fail(err), more=False)
        else:
            await self._whole(send, err.http_status, error_body(err))

    async def _collected(self, send: Send, events: AsyncIterator[tuple[str, bytes]]) -> None:
        async for typ, raw in events:
            data = orjson.loads(raw) if raw else {}
            if typ == "error":
                raise agent_error(data)
            self.shape.event(typ, data)
        await self._whole(send, 200, self.shape.whole())

    async def _streamed(self, send: Send, events: AsyncIterator[tuple[str, bytes]]) -> None:
        async for typ, raw in events:
            data = orjson.loads(raw) if raw else {}
            if not self._headers_sent:
                # Errors before the first event are plain HTTP errors with their status.
                self._headers_sent = True
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self._head(None)}
                )
                await self._write(send, self.shape.start())
            if typ == "error":
                err = agent_error(data)
                log.info("turn %s (session %s): agent error: %s", self.rid, self.session_id, err)
                await self._write(send, self.shape.fail(err), more=False)
                return
            await self._write(send, self.shape.event(typ, data))
        if not self._headers_sent:
            self._headers_sent = True
            await send({"type": "http.response.start", "status": 200, "headers": self._head(None)})
            await self._write(send, self.shape.start())
        await self._write(send, self.shape.finish(), more=False)


async def _close_quietly(gw: Gateway, session_id: str) -> None:
    try:
        client = await proxy_of(gw, session_id)
        await client.close_session(session_id)
    except ServiceError as exc:
        log.info("closing one-request session %s: %s", session_id, exc.message)
    await release(gw, session_id)


# --- request parsing --------------------------------------------------------------------------


def _last_user_content(items: list[Any], param: str) -> Any:
    for item in reversed(items):
        if not isinstance(item, dict):
            raise bad_request(f"'{param}' items must be objects.", code="invalid_type", param=param)
        if item.get("role") == "user" and item.get("type", "message") == "message":
            content = item.get("content")
            if content is None:
                break
            return normalize_content(content)
    raise bad_request(
        f"'{param}' must contain a user message (the turn's message).",
        code="missing_user_message",
        param=param,
    )


def _model(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    return model if isinstance(model, str) and model else "agent"


async def _session_for(
    gw: Gateway, p: Principal, metadata: dict[str, Any], previous: str | None
) -> tuple[str, bool]:
    """(session id, newly made) for this turn."""
    asked = metadata.pop("session_id", None)
    if asked is not None and (not isinstance(asked, str) or not asked):
        raise bad_request(
            "'metadata.session_id' must be a non-empty string.",
            code="invalid_type",
            param="metadata.session_id",
        )
    if previous is not None:
        from_prev = session_of_response(previous)
        if from_prev is None:
            raise bad_request(
                f"'previous_response_id' {previous!r} was not made by this agent service.",
                code="invalid_value",
                param="previous_response_id",
            )
        if asked is not None and asked != from_prev:
            raise bad_request(
                "'metadata.session_id' and 'previous_response_id' name different sessions.",
                code="session_mismatch",
                param="previous_response_id",
            )
        asked = from_prev
    if not p.is_admin:
        sid = asked or p.session_id
        check_session_access(p, sid)
        return sid, False
    if asked:
        return asked, False
    created = await create_session(gw, {}, idle_timeout=IMPLICIT_SESSION_TTL_S)
    return created["session_id"], True


async def responses(request: Request) -> Response:
    gw = gateway(request)
    p = principal(gw, request)
    # An agent turn's conversation may be long: bounded by the structure any request may have.
    doc = parse_bounded(await read_body(request, gw.settings.max_body_bytes), MAX_STRUCTURE_NS)
    stream = stream_flag(doc)
    raw_input = doc.get("input")
    if isinstance(raw_input, str):
        message: Any = raw_input
    elif isinstance(raw_input, list) and raw_input:
        message = _last_user_content(raw_input, "input")
    else:
        raise bad_request(
            "'input' must be a string or a non-empty array of messages.",
            code="missing_required_parameter" if raw_input is None else "invalid_type",
            param="input",
        )
    metadata = metadata_of(doc)
    previous = doc.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request(
            "'previous_response_id' must be a string.",
            code="invalid_type",
            param="previous_response_id",
        )
    store = store_flag(doc)
    sid, made = await _session_for(gw, p, metadata, previous)
    shape = ResponsesShape(sid, _model(doc), {**metadata, "session_id": sid}, previous, store)
    # A session made for this turn: `store: false` (nothing to chain on) ends it after the
    # turn; otherwise it stays for `previous_response_id`, idle for IMPLICIT_SESSION_TTL_S.
    return TurnResponse(
        gw,
        p,
        request_id(request),
        sid,
        message,
        metadata,
        stream,
        shape,
        _model(doc),
        ephemeral=made and not store,
    )


async def chat_completions(request: Request) -> Response:
    gw = gateway(request)
    p = principal(gw, request)
    # An agent turn's conversation may be long: bounded by the structure any request may have.
    doc = parse_bounded(await read_body(request, gw.settings.max_body_bytes), MAX_STRUCTURE_NS)
    stream = stream_flag(doc)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' must be a non-empty array.",
            code="missing_required_parameter" if messages is None else "invalid_type",
            param="messages",
        )
    message = _last_user_content(messages, "messages")
    metadata = metadata_of(doc)
    sid, made = await _session_for(gw, p, metadata, None)
    shape = ChatShape(sid, _model(doc))
    return TurnResponse(
        gw,
        p,
        request_id(request),
        sid,
        message,
        metadata,
        stream,
        shape,
        _model(doc),
        ephemeral=made,
    )


routes = [
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/responses", responses, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/chat/completions", chat_completions, methods=["POST"]),
]
