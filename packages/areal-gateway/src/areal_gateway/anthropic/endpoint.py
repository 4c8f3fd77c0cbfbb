"""`POST /v1/messages` on the inference gateway.

    auth (x-api-key or a bearer key) -> body -> translate (request.py) -> the chat body down
    the chat generation path (openai/forward.py: Route, the proxy's Generate, or an external
    model's /chat/completions) -> the chat answer translated back (response.py)

`MessagesGeneration` is the chat path's `GenerationResponse` with its output and its errors
translated: errors before the first chunk are whole HTTP errors in Anthropic's shape and
status (errors.py), a failure mid-stream an `error` event; a client that goes away cancels the
generation the same way, and with a session key the proxy records the interaction on the
session exactly as a chat.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Send

from areal_gateway.anthropic import response
from areal_gateway.anthropic.errors import error_event, error_response
from areal_gateway.anthropic.request import Translated, translate
from areal_gateway.auth import Principal
from areal_gateway.clients import ProxyClient
from areal_gateway.openai.forward import Endpoint, GenerationResponse
from areal_gateway.runtime import Gateway
from areal_runtime.errors import ServiceError, UpstreamError, error_for

MESSAGES = Endpoint(
    label="messages",
    external_path="/chat/completions",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)

# Not served (fastpath.py answers it with a 404); an endpoint for its metrics label and
# its errors' shape.
COUNT_TOKENS = Endpoint(
    label="messages_count_tokens",
    external_path="",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)


class MessagesGeneration(GenerationResponse):
    def __init__(self, gw: Gateway, principal: Principal, request_id: str, t: Translated) -> None:
        body = orjson.dumps(t.chat)
        super().__init__(gw, MESSAGES, principal, request_id, t.model, t.stream, body, t.chat)
        self.t = t
        self.translator = response.StreamTranslator(t.model, t.stop_sequences)
        self._sse = b""  # an external model's event stream, not yet a whole event

    async def _send_error(self, send: Send, err: ServiceError) -> None:
        self.gw.metrics.errors.labels(str(err.http_status), err.code or "").inc()
        if self._headers_sent:
            await send({"type": "http.response.body", "body": self._stream_failed(err)})
            return
        status, body = error_response(err)
        await self._send_whole(send, status, body)

    # -- the translated output --
    def _result(self, body: bytes) -> bytes:
        try:
            return response.whole(body, self.t.model, self.t.stop_sequences)
        except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError) as exc:
            raise UpstreamError(f"The model's answer is not a chat completion ({exc}).") from None

    def _stream_frames(self, batch: list[bytes]) -> bytes:
        return self.translator.chunks(batch)

    def _stream_done(self) -> bytes:
        return self.translator.end()

    def _stream_failed(self, err: ServiceError) -> bytes:
        return error_event(err)

    async def _send_upstream_whole(self, send: Send, status: int, body: bytes, ctype: str) -> None:
        if status < 300:
            await super()._send_upstream_whole(send, status, body, ctype)
            return
        # An external model's OpenAI-shaped error, answered in Anthropic's shape.
        try:
            message = orjson.loads(body)["error"]["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = None
        if not isinstance(message, str):
            raise UpstreamError(f"External model {self.model!r} answered {status}.")
        raise error_for(status, message)

    def _external_bytes(self, chunk: bytes) -> bytes:
        buf = self._sse + chunk.replace(b"\r\n", b"\n")
        *events, self._sse = buf.split(b"\n\n")
        batch: list[bytes] = []
        for ev in events:
            data = [ln[5:].strip() for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            payload = b"\n".join(data)
            if payload and payload != b"[DONE]":
                batch.append(payload)
        return self.translator.chunks(batch) if batch else b""

    def _external_done(self) -> bytes:
        return self._stream_done()


def prepare(
    gw: Gateway, principal: Principal, request_id: str, doc: dict[str, Any]
) -> MessagesGeneration:
    return MessagesGeneration(gw, principal, request_id, translate(doc))
