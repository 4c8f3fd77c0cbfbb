"""`GET /v1/models` in agent mode: the agent, as the one model (OpenAI list schema).

The agent gateway takes any `model` in a turn; `agent` (the router model every pair is
registered under) is the name its clients send, so that is the id listed. Auth as on the
inference gateway's `/v1/models`: the admin key or a valid session key.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.agent.common import AGENT_MODEL, gateway, principal
from areal_gateway.runtime import Gateway
from areal_runtime.errors import ServiceError, UnknownModel


async def _agent_model(gw: Gateway) -> dict[str, object]:
    # Created: when the first pair registered the model at the router; before that (or with
    # the router away: listing the agent needs no router) this gateway's start.
    created = int(gw.started_at)
    try:
        models = await gw.catalog.list()
    except ServiceError:
        models = []
    for m in models:
        if m.name == AGENT_MODEL and m.created_unix_s:
            created = int(m.created_unix_s)
    return {"id": AGENT_MODEL, "object": "model", "created": created, "owned_by": "areal"}


async def list_models(request: Request) -> Response:
    gw = gateway(request)
    principal(gw, request)
    body = {"object": "list", "data": [await _agent_model(gw)]}
    return Response(orjson.dumps(body), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    gw = gateway(request)
    principal(gw, request)
    name = request.path_params["name"]
    if name != AGENT_MODEL:
        raise UnknownModel(f"The model {name!r} does not exist.", param="model")
    return Response(orjson.dumps(await _agent_model(gw)), media_type="application/json")


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/models", list_models, methods=["GET"]),
    Route("/v1/models/{name:path}", retrieve_model, methods=["GET"]),
]
