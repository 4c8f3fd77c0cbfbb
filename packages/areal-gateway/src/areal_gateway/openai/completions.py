"""`POST /v1/completions` (alias `/completions`, text or token-id prompts): what `fastpath`
needs for it."""

from __future__ import annotations

from typing import Any

from areal_gateway.clients import ProxyClient
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import Endpoint

COMPLETIONS = Endpoint(
    label="completions",
    external_path="/completions",
    unary=ProxyClient.completion,
    stream=ProxyClient.completion_stream,
)


def check_completion(doc: dict[str, Any]) -> None:
    if doc.get("prompt") is None:
        raise bad_request(
            "Missing required parameter: 'prompt'.",
            code="missing_required_parameter",
            param="prompt",
        )
