"""`GET /openapi.json` and `GET /docs`: the whole HTTP surface, readable without a key.

The document holds no secret (it describes, it stores nothing), so, like OpenAI's own
published spec, it is open; every operation in it still needs a key. It is built once, from
two kinds of routes:

- the FastAPI routes the app serves (admin, RL, control, agent sessions and pairs, and
  `GET`/`DELETE /v1/responses/{id}`), with the models they validate against;
- operations served OUTSIDE FastAPI, described here by routes that are never mounted: the
  generation endpoints, which the fast path in front of the app serves (fastpath.py: no
  FastAPI layer is added to them), the model list, and in agent mode the turns. Their
  bodies are the models of openai/shapes.py.

The example bodies of the generation endpoints name a model: a served model is not known
when the document is written, so each answer of `GET /openapi.json` puts one of the
catalog's models (an internal one first, by name) where `shapes.MODEL_EXAMPLE` stands, and
"Try it out" on `/docs` sends a body that works. With no model registered yet the
placeholder stays, and names where to look (`GET /v1/models`).

`/docs` is Swagger UI with its script and style served by the gateway itself (the
fastapi-offline package ships them): FastAPI's default page would load them from a CDN and
stay blank without network.
"""

from __future__ import annotations

import inspect
import re
from enum import Enum
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from starlette.responses import Response

from areal_gateway.api import ERRORS, AnyKey
from areal_gateway.openai import shapes

_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _op(
    router: APIRouter,
    method: str,
    path: str,
    body: type[BaseModel] | None,
    answer: type[BaseModel],
    summary: str,
    operation_id: str,
    *,
    stream: bool = False,
    tags: list[str],
) -> None:
    """Describe `method path` (never served through this router)."""

    async def described(**_: Any) -> Response:  # pragma: no cover - never mounted
        # Only its signature feeds the schema; the fast path serves the route itself.
        raise RuntimeError(f"{method} {path} is a documentation route, never served")

    # The parameters FastAPI documents: the body's model, and the key (the security scheme).
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("key", kw, annotation=AnyKey)]
    params += [inspect.Parameter(n, kw, annotation=str) for n in re.findall(r"{(\w+)}", path)]
    if body is not None:
        params.append(inspect.Parameter("body", kw, annotation=body))
    described.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    responses: dict[int | str, dict[str, Any]] = dict(ERRORS)
    if stream:
        responses[200] = {
            "description": "the answer; with `stream: true` a `text/event-stream` of events",
            "content": _SSE,
        }
    router.add_api_route(
        path,
        described,
        methods=[method],
        response_model=answer,
        summary=summary,
        operation_id=operation_id,
        description=inspect.cleandoc((body or answer).__doc__ or ""),
        responses=responses,
        tags=list[str | Enum](tags),
    )


class AgentResponsesTurn(BaseModel):
    """`POST /v1/responses` in agent mode: one turn of an agent session (its last user
    message goes to the agent)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    previous_response_id: str | None = Field(default=None, description="continue its session")
    metadata: dict[str, Any] | None = Field(default=None, description="session_id: which session")
    store: bool = True
    stream: bool = False


class AgentChatTurn(BaseModel):
    """`POST /v1/chat/completions` in agent mode: one turn of an agent session (the last
    user message goes to the agent)."""

    messages: list[shapes.ChatMessage] = Field(min_length=1)
    model: str | None = None
    metadata: dict[str, Any] | None = Field(default=None, description="session_id: which session")
    stream: bool = False


def described_routes(mode: str) -> list[Any]:
    """The operations the app serves outside FastAPI's routing, as routes to document."""
    r = APIRouter()
    models = ["OpenAI: models"]
    if mode == "inference":
        gen = ["OpenAI: generation"]
        _op(r, "POST", "/v1/chat/completions", shapes.ChatCompletionRequest,
            shapes.ChatCompletion, "Create a chat completion", "createChatCompletion",
            stream=True, tags=gen)  # fmt: skip
        _op(r, "POST", "/v1/completions", shapes.CompletionRequest, shapes.Completion,
            "Create a completion", "createCompletion", stream=True, tags=gen)  # fmt: skip
        _op(r, "POST", "/v1/responses", shapes.CreateResponseRequest, shapes.ResponseObject,
            "Create a response", "createResponse", stream=True,
            tags=["OpenAI: responses"])  # fmt: skip
        _op(r, "POST", "/v1/messages", shapes.MessagesRequest, shapes.MessageObject,
            "Create a message (Anthropic; the key as x-api-key or a bearer)", "createMessage",
            stream=True, tags=["Anthropic: messages"])  # fmt: skip
        _op(r, "POST", "/v1/messages/count_tokens", shapes.CountTokensRequest,
            shapes.MessageTokensCount, "Count a message's input tokens (Anthropic)",
            "countMessageTokens", tags=["Anthropic: messages"])  # fmt: skip
    else:
        turns = ["Agent: turns"]
        _op(r, "POST", "/v1/responses", AgentResponsesTurn, shapes.ResponseObject,
            "An agent turn, as a response", "agentTurnResponse", stream=True,
            tags=turns)  # fmt: skip
        _op(r, "POST", "/v1/chat/completions", AgentChatTurn, shapes.ChatCompletion,
            "An agent turn, as a chat completion", "agentTurnChat", stream=True,
            tags=turns)  # fmt: skip
    _op(r, "GET", "/v1/models", None, shapes.ModelObjectList, "List models", "listModels",
        tags=models)  # fmt: skip
    _op(r, "GET", "/v1/models/{name}", None, shapes.ModelObject, "Retrieve a model",
        "retrieveModel", tags=models)  # fmt: skip
    return list(r.routes)


def install(app: FastAPI, mode: str, summary: str) -> None:
    """Build `app`'s document from its routes and the described ones, once."""
    extra = described_routes(mode)

    served: dict[str, dict[str, Any]] = {}  # the document with each example model put in

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=summary,
                description="Every operation needs a key: the admin key or a session key "
                "(`Authorization: Bearer ...`). The OpenAI and Anthropic endpoints answer in "
                "their own shapes; docs/services.md has the details.",
                routes=[*app.routes, *extra],
            )
        gateway = getattr(app.state, "gateway", None)
        name = gateway.catalog.example_model() if gateway is not None else ""
        if not name:
            return app.openapi_schema
        doc = served.get(name)
        if doc is None:
            if len(served) > 16:  # models come and go: keep a few documents, not all
                served.clear()
            raw = orjson.dumps(app.openapi_schema)
            doc = served[name] = orjson.loads(
                raw.replace(orjson.dumps(shapes.MODEL_EXAMPLE), orjson.dumps(name))
            )
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
