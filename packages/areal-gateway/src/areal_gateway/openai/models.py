"""`GET /v1/models` in the OpenAI list schema (works with `client.models.list()`).

From the router's ListModels, cached for at most one second. External models are listed
only to the admin key (a session key may not use them).
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.runtime import Gateway
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import UnknownModel


def _model_object(m: router_pb2.ModelInfo) -> dict[str, object]:
    external = m.kind == router_pb2.MODEL_KIND_EXTERNAL
    return {
        "id": m.name,
        "object": "model",
        "created": int(m.created_unix_s),
        "owned_by": "external" if external else "areal",
    }


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    principal = gw.auth.principal(request)
    models = await gw.catalog.list()
    data = [
        _model_object(m)
        for m in sorted(models, key=lambda m: m.name)
        if principal.is_admin or m.kind != router_pb2.MODEL_KIND_EXTERNAL
    ]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    name = request.path_params["name"]
    gw: Gateway = request.app.state.gateway
    principal = gw.auth.principal(request)
    for m in await gw.catalog.list():
        if m.name == name and (principal.is_admin or m.kind != router_pb2.MODEL_KIND_EXTERNAL):
            return Response(orjson.dumps(_model_object(m)), media_type="application/json")
    raise UnknownModel(f"The model {name!r} does not exist.", param="model")


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/models", list_models, methods=["GET"]),
    Route("/v1/models/{name:path}", retrieve_model, methods=["GET"]),
]
