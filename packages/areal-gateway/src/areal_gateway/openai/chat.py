"""`POST /v1/chat/completions` (alias `/chat/completions`): what `fastpath` needs for it.

The gateway checks only what it acts on; the proxy validates the rest (roles, max_tokens,
types) and its 400 passes through unchanged. The body bytes are forwarded as received.
"""

from __future__ import annotations

from typing import Any

from areal_gateway.clients import ProxyClient
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import Endpoint

CHAT = Endpoint(
    label="chat",
    external_path="/chat/completions",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)


def check_chat(doc: dict[str, Any]) -> None:
    messages = doc.get("messages")
    if messages is None:
        raise bad_request(
            "Missing required parameter: 'messages'.",
            code="missing_required_parameter",
            param="messages",
        )
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array.", code="invalid_type", param="messages")
    if not messages:
        raise bad_request(
            "'messages' must contain at least one message.", code="empty_array", param="messages"
        )
