"""The generation endpoints without the framework's per-request layers.

`POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses` (and their
aliases) are the hot path; the Responses endpoint is a translation onto the chat path
(openai/responses/), and so is Anthropic's `POST /v1/messages` (anthropic/), which takes its
key from `x-api-key` too and answers errors in Anthropic's shape.
Through FastAPI each request would pass some ten ASGI layers (error middleware, telemetry, body
limit, exception handlers, exit stack, router, request/response wrapper), each wrapping
`send` once more. `GenerationFastPath` sits in front of the app and is the only implementation
of these endpoints (the app has no route for them): OpenAI-shaped errors (a 413 closes the
connection, anything unexpected is a logged 500, another method is a 405), and the same
request metrics as `MetricsMiddleware`. Every other path, lifespan, and agent mode (whose
chat completions are agent turns) go to the app unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from areal_gateway.anthropic import endpoint as messages
from areal_gateway.anthropic.errors import error_response as anthropic_error
from areal_gateway.auth import Principal, bearer_key
from areal_gateway.metrics import NO_MODEL, outcome
from areal_gateway.openai import screen
from areal_gateway.openai.chat import CHAT, check_chat
from areal_gateway.openai.completions import COMPLETIONS, check_completion
from areal_gateway.openai.errors import error_body
from areal_gateway.openai.forward import (
    CALL_HEADER,
    Endpoint,
    GenerationResponse,
    call_kind,
    choose_request_id,
    parse_model_and_stream,
    parse_object,
    receive_body,
)
from areal_gateway.openai.responses import endpoint as responses
from areal_gateway.runtime import Gateway
from areal_runtime.bodycost import parses_inline, too_complex
from areal_runtime.errors import (
    InternalError,
    PayloadTooLarge,
    ServiceError,
    Unauthenticated,
)
from areal_runtime.offload import OffloadFailed

log = logging.getLogger(__name__)

# Sessions whose last answered body size is remembered (a few MB of memory at most).
_SESSION_SIZES = 65_536

_ENDPOINTS: dict[str, tuple[Endpoint, Any]] = {
    "/v1/chat/completions": (CHAT, check_chat),
    "/chat/completions": (CHAT, check_chat),
    "/v1/completions": (COMPLETIONS, check_completion),
    "/completions": (COMPLETIONS, check_completion),
    "/v1/responses": (responses.RESPONSES, None),
    "/responses": (responses.RESPONSES, None),
    "/v1/messages": (messages.MESSAGES, None),
    # Anthropic's token counter: the model's own template and tokenizer, at a proxy of it.
    "/v1/messages/count_tokens": (messages.COUNT_TOKENS, None),
}
# The screen's frame kind of each endpoint it reads (Responses is read here: see _parsed).
_SCREEN_KINDS = {
    CHAT.label: screen.CHAT,
    COMPLETIONS.label: screen.COMPLETION,
    messages.MESSAGES.label: screen.MESSAGES,
    messages.COUNT_TOKENS.label: screen.COUNT_TOKENS,
}
# Endpoints of Anthropic's API: key from x-api-key too, errors in Anthropic's shape.
_ANTHROPIC = (messages.MESSAGES, messages.COUNT_TOKENS)


def _error(endpoint: Endpoint, err: ServiceError) -> tuple[int, bytes]:
    """(status, body) of an error answered before generation, in the endpoint's protocol."""
    if endpoint in _ANTHROPIC:
        return anthropic_error(err)
    return err.http_status, error_body(err)


class GenerationFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        state = getattr(app, "state", None)
        gw: Gateway | None = getattr(state, "gateway", None) if state is not None else None
        self.gateway = gw
        self.enabled = gw is not None and gw.settings.mode == "inference"
        self._children: dict[str, tuple[Any, Any]] = {}
        self._status: dict[tuple[str, str, str], Any] = {}
        # The size of the last body each session had answered (least recently used dropped):
        # a session's next body, grown by less than the screen's threshold, is its previous
        # conversation plus a turn, and is parsed here like a small one. A long agent session
        # passes 256 KiB after some 60 turns; the detour through the screen would then tax
        # every later turn of the legitimate traffic the threshold was not meant for. Growth
        # is no pass on cost: a body whose parse is estimated too long for the loop goes to
        # the screen whatever its size was last turn (_goes_to_screen).
        self._session_bodies: OrderedDict[str, int] = OrderedDict()

    def _continues_session(self, session_id: str, size: int) -> bool:
        known = self._session_bodies.get(session_id)
        return known is not None and size - known <= screen.SCREEN_MIN_BODY

    def _goes_to_screen(self, principal: Principal, body: bytes) -> bool:
        """A body the loop must not parse: over the screen's size, unless it continues its
        session by at most that much (a long session's next turn); and, however it was
        reached, one whose estimated parse (bytes and structure: areal_runtime.bodycost) is
        over what the loop may spend on one body."""
        if not parses_inline(body):
            return True
        return len(body) > screen.SCREEN_MIN_BODY and not self._continues_session(
            principal.session_id, len(body)
        )

    def _answered(self, response: GenerationResponse, size: int) -> None:
        sid = response.principal.session_id
        if sid and size:
            self._session_bodies[sid] = size
            self._session_bodies.move_to_end(sid)
            if len(self._session_bodies) > _SESSION_SIZES:
                self._session_bodies.popitem(last=False)

    # Same series as MetricsMiddleware (one child lookup per label, then cached).
    def _metrics(self, label: str) -> tuple[Any, Any]:
        children = self._children.get(label)
        if children is None:
            assert self.gateway is not None
            m = self.gateway.metrics
            children = self._children[label] = (m.inflight.labels(label), m.latency.labels(label))
        return children

    def _count(
        self, label: str, status: int, scope: Scope | None = None, started: bool = True
    ) -> None:
        key = (
            (label, *outcome(scope, status, started))
            if scope is not None
            else (label, str(status), NO_MODEL)
        )
        child = self._status.get(key)
        if child is None:
            assert self.gateway is not None
            child = self._status[key] = self.gateway.metrics.requests.labels(*key)
        child.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.enabled and scope["type"] == "http":
            found = _ENDPOINTS.get(scope["path"])
            if found is not None:
                if scope["method"] == "POST":
                    await self._generate(found[0], found[1], scope, receive, send)
                else:
                    await self._not_allowed(scope, send)
                return
        await self.app(scope, receive, send)

    async def _not_allowed(self, scope: Scope, send: Send) -> None:
        # The app has no route for these paths, so it would answer 404; they exist, for POST.
        err = ServiceError(
            405,
            f"Method {scope['method']} is not allowed on {scope['path']}",
            code="method_not_allowed",
        )
        headers = [(b"content-type", b"application/json"), (b"allow", b"POST")]
        endpoint = _ENDPOINTS[scope["path"]][0]
        await _whole(send, 405, _error(endpoint, err)[1], headers)
        self._count(endpoint.label, 405)

    async def _generate(
        self, endpoint: Endpoint, check: Any, scope: Scope, receive: Receive, send: Send
    ) -> None:
        label = endpoint.label
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
                if isinstance(err, PayloadTooLarge):  # the rest of the body is never read
                    headers.append((b"connection", b"close"))
                await _whole(send_counted, *_error(endpoint, err), headers)
                return
            await response(scope, receive, send_counted)
            if status == 200:
                self._answered(response, response.client_body_bytes)
        except Exception as exc:
            log.error("unhandled error on POST %s: %r", scope["path"], exc, exc_info=exc)
            if started:
                raise
            internal = InternalError("Internal error in the gateway.")
            await _whole(
                send_counted, *_error(endpoint, internal), [(b"content-type", b"application/json")]
            )
        finally:
            inflight.dec()
            latency.observe(time.perf_counter() - start)
            self._count(label, status, scope, started)

    async def _prepare(
        self, endpoint: Endpoint, check: Any, scope: Scope, receive: Receive
    ) -> GenerationResponse:
        """auth -> body -> parse -> check, reading the headers it needs straight off the
        scope (the first occurrence of each, as Starlette's `Headers.get`)."""
        gw = self.gateway
        assert gw is not None
        auth = length = rid = api_key = call = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if auth is None:
                    auth = value.decode("latin-1")
            elif name == b"x-api-key":
                if api_key is None:
                    api_key = value.decode("latin-1").strip() or None
            elif name == b"content-length":
                if length is None:
                    length = value.decode("latin-1")
            elif name == b"x-request-id" and rid is None:
                rid = value.decode("latin-1")
            elif name == CALL_HEADER and call is None:
                call = value.decode("latin-1")
        if endpoint in _ANTHROPIC:
            principal = self._anthropic_principal(api_key, auth)
        else:
            principal = gw.auth.authenticate(bearer_key(auth))
        kind = call_kind(call)
        response = await self._response(endpoint, check, principal, rid, length, receive)
        response.call_kind = kind
        return response

    async def _response(
        self,
        endpoint: Endpoint,
        check: Any,
        principal: Principal,
        rid: str | None,
        length: str | None,
        receive: Receive,
    ) -> GenerationResponse:
        """body -> parse -> check: the response that will do the rest."""
        gw = self.gateway
        assert gw is not None
        body = await receive_body(receive, length, gw.settings.max_body_bytes)
        response = await self._parsed(endpoint, check, principal, choose_request_id(rid), body)
        response.client_body_bytes = len(body)
        return response

    async def _parsed(
        self, endpoint: Endpoint, check: Any, principal: Principal, rid: str, body: bytes
    ) -> GenerationResponse:
        gw = self.gateway
        assert gw is not None
        if self._goes_to_screen(principal, body):
            if endpoint is responses.RESPONSES:
                # Its translation needs the response store: read here, once the body is
                # known not to be one no hop should parse (its size alone is the cost left).
                refused = too_complex(body)
                if refused is not None:
                    raise refused
            else:
                found = await self._screened(endpoint, body)
                if found is not None:
                    if found.translated is not None:
                        assert found.chat_body is not None
                        return messages.prepared(
                            gw, endpoint, principal, rid, found.translated,
                            found.chat_body, found.prefix,
                        )  # fmt: skip
                    return GenerationResponse(
                        gw, endpoint, principal, rid, found.model, found.stream, body, None,
                        found.prefix,
                    )  # fmt: skip
        doc = parse_object(body)
        if endpoint is responses.RESPONSES:
            return await responses.prepare(gw, gw.responses, principal, rid, doc)
        if endpoint is messages.MESSAGES:
            return messages.prepare(gw, principal, rid, doc)
        if endpoint is messages.COUNT_TOKENS:
            return messages.prepare_count(gw, principal, rid, doc)
        model, stream = parse_model_and_stream(doc)
        check(doc)
        return GenerationResponse(gw, endpoint, principal, rid, model, stream, body, doc)

    def _anthropic_principal(self, api_key: str | None, auth: str | None) -> Principal:
        """Anthropic's clients send the key as `x-api-key` (or, given a token, as a bearer)."""
        assert self.gateway is not None
        try:
            return self.gateway.auth.authenticate(api_key or bearer_key(auth))
        except Unauthenticated as err:
            if err.code != "missing_api_key":
                raise
            raise Unauthenticated(
                "Missing API key: send 'x-api-key: <key>' (or 'Authorization: Bearer <key>').",
                code="missing_api_key",
            ) from None

    async def _screened(self, endpoint: Endpoint, body: bytes) -> screen.Screened | None:
        """What the screen read from a huge body (or the error it found), None if it failed:
        the caller then parses the body itself."""
        kind = _SCREEN_KINDS[endpoint.label]
        try:
            assert self.gateway is not None
            raw = await self.gateway.screen.call(kind, body)
        except OffloadFailed as exc:
            log.warning("body screen: %s; parsing the body here", exc)
            return None
        return screen.answer_of(raw)


async def _whole(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
