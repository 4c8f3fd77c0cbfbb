"""`POST /v1/completions` (alias `/completions`): text or token-id prompts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from areal_gateway.clients import ProxyClient
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import Endpoint, GenerationResponse, handle

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


router = APIRouter()


async def completions(request: Request) -> GenerationResponse:
    return await handle(request, COMPLETIONS, check_completion)


for _path in ("/v1/completions", "/completions"):
    router.add_api_route(
        _path, completions, methods=["POST"], include_in_schema=False, response_model=None
    )
