"""Admin endpoints of the agent gateway: pairs (worker + data proxy) and their health.

| POST   /admin/pairs              | {"proxy_id", "address"} | 201: the pair's proxy joins the router |
| DELETE /admin/pairs/{proxy_id}   | —                       | 200; 404 if unknown                    |
| GET    /admin/pairs              | —                       | {"pairs": [worker JSON]}               |
| GET    /admin/workers            | —                       | {"workers": [worker JSON]}             |

Every pair's proxy is registered as kind AGENT under the model `agent` (made on first use).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.admin import _address, _str_field, list_workers, worker_json
from areal_gateway.agent.common import (
    AGENT_KIND,
    AGENT_MODEL,
    gateway,
    json_response,
    log,
    principal,
    require_admin,
)
from areal_gateway.openai.forward import parse_object, read_body
from areal_gateway.runtime import Gateway
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import NotFound


async def _admin(request: Request) -> Gateway:
    gw = gateway(request)
    require_admin(principal(gw, request))
    return gw


async def _ensure_model(gw: Gateway) -> None:
    if any(m.name == AGENT_MODEL for m in await gw.router.list_models()):
        return
    await gw.router.register_model(
        router_pb2.ModelInfo(
            name=AGENT_MODEL, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=int(time.time())
        )
    )


async def add_pair(request: Request) -> Response:
    gw = await _admin(request)
    doc = parse_object(await read_body(request, gw.settings.max_body_bytes))
    proxy_id = _str_field(doc, "proxy_id")
    address = _address(doc, "")
    await _ensure_model(gw)
    await gw.router.register_proxy(
        router_pb2.ProxyInfo(proxy_id=proxy_id, address=address, model=AGENT_MODEL, kind=AGENT_KIND)
    )
    log.info("pair %s registered at %s", proxy_id, address)
    return json_response({"proxy_id": proxy_id, "address": address, "model": AGENT_MODEL}, 201)


async def remove_pair(request: Request) -> Response:
    proxy_id = request.path_params["proxy_id"]
    gw = await _admin(request)
    if not await gw.router.deregister_proxy(proxy_id):
        raise NotFound(f"pair {proxy_id!r} is not registered", code="pair_not_found")
    log.info("pair %s deregistered", proxy_id)
    return json_response({"proxy_id": proxy_id, "removed": True})


async def list_pairs(request: Request) -> Response:
    gw = await _admin(request)
    proxies = await gw.router.list_proxies(AGENT_MODEL, AGENT_KIND)
    return json_response(
        {"pairs": [worker_json(p) for p in sorted(proxies, key=lambda p: p.proxy_id)]}
    )


routes = [
    Route("/admin/pairs", add_pair, methods=["POST"]),
    Route("/admin/pairs", list_pairs, methods=["GET"]),
    Route("/admin/pairs/{proxy_id}", remove_pair, methods=["DELETE"]),
    Route("/admin/workers", list_workers, methods=["GET"]),
]
