"""`POST /v1/completions` (alias `/completions`, text or token-id prompts): what `fastpath`
needs for it."""

from __future__ import annotations

from typing import Any

from areal_gateway.clients import ProxyClient
from areal_gateway.openai.forward import Endpoint
from areal_runtime.openai import prompt_of

COMPLETIONS = Endpoint(
    label="completions",
    external_path="/completions",
    unary=ProxyClient.completion,
    stream=ProxyClient.completion_stream,
)


def check_completion(doc: dict[str, Any]) -> None:
    prompt_of(doc)
