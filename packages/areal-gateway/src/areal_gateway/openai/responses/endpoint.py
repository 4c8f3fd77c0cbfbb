"""`POST /v1/responses` (alias `/responses`) on the inference gateway.

    auth -> body -> translate (request.py; previous_response_id from the store) -> the chat
    body down the chat generation path (openai/forward.py: Route, the proxy's Generate,
    or an external model's /chat/completions) -> the chat answer translated back (chat.py)

`ResponsesGeneration` is the chat path's `GenerationResponse` with its output translated:
errors before the first chunk are the same HTTP errors, a client that goes away cancels the
generation the same way, and with a session key the proxy records the interaction on the
session exactly as a chat. A completed (or incomplete) response with `store` not false is
stored (store.py) before its last bytes leave, for `previous_response_id` and `GET
/v1/responses/{id}`; a store that fails then is logged, and the answer still goes out.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import orjson

from areal_gateway.auth import Principal
from areal_gateway.clients import ProxyClient
from areal_gateway.openai.forward import Endpoint, GenerationResponse, parse_model_and_stream
from areal_gateway.openai.responses import chat
from areal_gateway.openai.responses.events import ResponseBuilder, new_id
from areal_gateway.openai.responses.items import output_to_items
from areal_gateway.openai.responses.request import (
    Translated,
    previous_id,
    refuse_unhonoured,
    translate,
)
from areal_gateway.openai.responses.store import Entry, ResponseStore, entry_size
from areal_gateway.runtime import Gateway
from areal_runtime.errors import InternalError, NotFound, ServiceError, UpstreamError
from areal_runtime.sse import SSEReader

log = logging.getLogger(__name__)

RESPONSES = Endpoint(
    label="responses",
    external_path="/chat/completions",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)

_ADMIN_OWNER = "\x00admin"


def owner_of(p: Principal) -> str:
    """Who may continue a stored response: its maker's session, or the admin key."""
    return p.session_id if p.session_id else _ADMIN_OWNER


class ResponsesGeneration(GenerationResponse):
    def __init__(
        self,
        gw: Gateway,
        principal: Principal,
        request_id: str,
        model: str,
        stream: bool,
        t: Translated,
        store: ResponseStore,
    ) -> None:
        body = orjson.dumps(t.chat)
        super().__init__(gw, RESPONSES, principal, request_id, model, stream, body, t.chat)
        self._request_bytes = len(body)
        self.t = t
        self.store = store
        self.builder = ResponseBuilder(
            new_id("resp"),
            model,
            echo=t.echo,
            metadata=t.metadata,
            previous_response_id=t.previous_response_id,
            stream=stream,
            summary=t.summary,
            encrypted_content=t.encrypted_content,
        )
        self.translator = chat.StreamTranslator(self.builder, t.tools)
        header = t.left_out.header()
        if header is not None:
            self.extra_headers.append(header)
        t.left_out.report(RESPONSES.label, request_id, gw.metrics.left_out)
        self._sse = SSEReader()  # an external model's event stream

    async def _finishing(self) -> None:
        b = self.builder
        if not self.t.store or b.status not in ("completed", "incomplete"):
            return
        outputs = output_to_items(b.items, b.chat_calls)
        response = orjson.dumps(b.response())
        size = entry_size(orjson.dumps(self.t.inputs), orjson.dumps(outputs), response)
        entry = Entry(
            b.id,
            owner_of(self.principal),
            self.t.previous_response_id,
            self.t.inputs,
            outputs,
            response,
            size,
        )
        try:
            await self.store.put(entry)
        except (sqlite3.Error, OSError) as exc:
            log.error("request %s: response %s not stored: %s", self.request_id, b.id, exc)

    # -- the translated output --
    def _result(self, body: bytes) -> bytes:
        try:
            out = chat.whole(body, self.builder, self.t.tools)
        except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError) as exc:
            raise UpstreamError(f"The model's answer is not a chat completion ({exc}).") from None
        return out

    def _stream_frames(self, batch: list[bytes]) -> bytes:
        return self.translator.chunks(batch)

    def _stream_done(self) -> bytes:
        return self.translator.end()

    def _stream_failed(self, err: ServiceError) -> bytes:
        out = b""
        if not self.translator.started:
            self.translator.started = True
            out = self.builder.start()
        return out + self.builder.fail(err.code or err.type or "error", err.message, err.param)

    def _external_bytes(self, chunk: bytes) -> bytes:
        batch = [p for p in self._sse.feed(chunk) if p and p != b"[DONE]"]
        return self.translator.chunks(batch) if batch else b""

    def _external_done(self) -> bytes:
        return self._stream_done()


async def prepare(
    gw: Gateway,
    store: ResponseStore,
    principal: Principal,
    request_id: str,
    doc: dict[str, Any],
) -> ResponsesGeneration:
    model, stream = parse_model_and_stream(doc)
    refuse_unhonoured(doc)  # a 400 for what areal does not honour comes before a lookup's 404
    previous = previous_id(doc)
    history: list[dict[str, Any]] | None = None
    if previous is not None:
        try:
            history = await store.conversation(previous, owner_of(principal))
        except (sqlite3.Error, OSError) as exc:
            log.error("request %s: the response store failed: %s", request_id, exc)
            raise InternalError("The gateway's response store failed; try again.") from None
        if history is None:
            raise NotFound(
                f"Previous response with id {previous!r} not found (unknown, expired, deleted, "
                "made with 'store': false or by another key, or an earlier turn of its chain "
                "is gone).",
                code="previous_response_not_found",
                param="previous_response_id",
            )
    found = history

    def lookup(_: str) -> list[dict[str, Any]]:
        assert found is not None
        return found

    t = translate(doc, model, stream, lookup)
    return ResponsesGeneration(gw, principal, request_id, model, stream, t, store)
