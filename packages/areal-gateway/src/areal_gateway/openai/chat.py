"""`POST /v1/chat/completions` (alias `/chat/completions`): what `fastpath` needs for it.

The gateway checks only what it acts on, with the protocol's own checks
(areal_runtime.openai); the proxy checks the rest with the same code (roles, max_tokens,
types: what a field may be depends on the model, and an external one takes what its server
takes), and its 400 passes through unchanged. The body bytes are forwarded as received.
"""

from __future__ import annotations

from typing import Any

from areal_gateway.clients import ProxyClient
from areal_gateway.openai.forward import Endpoint
from areal_gateway.prefix import check_hashed
from areal_runtime.openai import messages_of

CHAT = Endpoint(
    label="chat",
    external_path="/chat/completions",
    unary=ProxyClient.chat_completion,
    stream=ProxyClient.chat_completion_stream,
)


def check_chat(doc: dict[str, Any]) -> None:
    # What cache-aware routing hashes is checked here, with the body's other checks (in the
    # screen too, for a huge body): a bad field is a 400 naming it, whatever the key.
    check_hashed(messages_of(doc))
