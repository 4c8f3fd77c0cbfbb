"""`POST /v1/messages` on the inference gateway.

    auth (x-api-key or a bearer key) -> body -> translate (request.py) -> the chat body down
    the chat generation path (openai/forward.py: Route, the proxy's Generate, or an external
    model's /chat/completions) -> the chat answer translated back (response.py)

`MessagesGeneration` is the chat path's `GenerationResponse` with its output and its errors
translated: errors before the first chunk are whole HTTP errors in Anthropic's shape and
status (errors.py), a failure mid-stream an `error` event; a client that goes away cancels the
generation the same way, and with a session key the proxy records the interaction on the
session exactly as a chat. What the translation left out of the prompt (server tools, ...)
is named in the `x-areal-left-out` header and reported to the operator (left_out.py).

`POST /v1/messages/count_tokens` (`CountTokens`) is the same translation and the same route
to a proxy of the model, which renders the chat body with the model's chat template and
tokenizes it (the proxy's `CountTokens`: nothing generated or recorded); the answer is
Anthropic's `{"input_tokens": N}`.
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
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import InvalidRequest, ServiceError, UpstreamError, error_for
from areal_runtime.sse import SSEReader

MESSAGES = Endpoint(
    label="messages",
    external_path="/chat/completions",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)

# Its label names its metrics; CountTokensResponse calls the proxy's CountTokens itself (the
# generation calls here are never made for it).
COUNT_TOKENS = Endpoint(
    label="messages_count_tokens",
    external_path="",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)

# The API label of what a request left out (the `areal_gateway_left_out_total` metric).
API = "messages"


class MessagesGeneration(GenerationResponse):
    def __init__(
        self,
        gw: Gateway,
        principal: Principal,
        request_id: str,
        t: Translated,
        endpoint: Endpoint = MESSAGES,
        screened: tuple[bytes, list[int]] | None = None,
    ) -> None:
        # `screened`: the chat body and its prefix hashes from the body screen
        # (openai/screen.py), which translated a huge body so that it is never parsed here.
        if screened is None:
            body, doc, prefix = orjson.dumps(t.chat), t.chat, None
        else:
            (body, prefix), doc = screened, None
        super().__init__(gw, endpoint, principal, request_id, t.model, t.stream, body, doc, prefix)
        self.t = t
        self.translator = response.StreamTranslator(t.model, t.stop_sequences, t.context_management)
        self._sse = SSEReader()  # an external model's event stream
        header = t.left_out.header()
        if header is not None:
            self.extra_headers.append(header)
            t.left_out.report(API, request_id, gw.metrics.left_out)

    async def _send_error(self, send: Send, err: ServiceError) -> None:
        if err.code == "chat_template_error" and self.t.system_at:
            # The model's template refused the conversation; a system message after the
            # first is what some templates refuse (it is sent where the harness put it).
            at = ", ".join(f"messages.{i}" for i in self.t.system_at)
            err = InvalidRequest(
                f"{err.message} (this model's chat template refused the conversation; "
                f"{at} is a system message inside the conversation, which some chat "
                "templates refuse: send its text in 'system' or in a user turn for this model)",
                code=err.code,
                param=err.param,
            )
        self.gw.metrics.errors.labels(str(err.http_status), err.code or "").inc()
        if self._headers_sent:
            await send({"type": "http.response.body", "body": self._stream_failed(err)})
            return
        status, body = error_response(err)
        self._say_retry_after(err)
        await self._send_whole(send, status, body)

    # -- the translated output --
    def _result(self, body: bytes) -> bytes:
        try:
            return response.whole(
                body, self.t.model, self.t.stop_sequences, self.t.context_management
            )
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
        batch = [p for p in self._sse.feed(chunk) if p and p != b"[DONE]"]
        return self.translator.chunks(batch) if batch else b""

    def _external_done(self) -> bytes:
        return self._stream_done()


class CountTokensResponse(MessagesGeneration):
    """`POST /v1/messages/count_tokens`: routed like a generation, answered by the proxy's
    `CountTokens` (the model's own template and tokenizer)."""

    async def _call_proxy(self, send: Send, client: ProxyClient) -> None:
        n = await client.count_tokens(self._request(), self.remaining())
        await self._send_whole(send, 200, orjson.dumps({"input_tokens": n}))

    async def _external(self, send: Send, model: router_pb2.ModelInfo) -> None:
        raise InvalidRequest(
            f"model {self.model!r} is an external model: areal counts tokens only for the "
            "models it serves (it holds no tokenizer of an external one)",
            code="unsupported_model",
            param="model",
        )


def prepare(
    gw: Gateway, principal: Principal, request_id: str, doc: dict[str, Any]
) -> MessagesGeneration:
    return MessagesGeneration(gw, principal, request_id, translate(doc))


def prepare_count(
    gw: Gateway, principal: Principal, request_id: str, doc: dict[str, Any]
) -> CountTokensResponse:
    return CountTokensResponse(
        gw, principal, request_id, translate(doc, counting=True), COUNT_TOKENS
    )


def prepared(
    gw: Gateway,
    endpoint: Endpoint,
    principal: Principal,
    request_id: str,
    t: Translated,
    chat_body: bytes,
    prefix: list[int],
) -> MessagesGeneration:
    """The response to a body the screen translated (`chat_body`, never parsed here)."""
    cls = CountTokensResponse if endpoint is COUNT_TOKENS else MessagesGeneration
    return cls(gw, principal, request_id, t, endpoint, (chat_body, prefix))
