"""Admin endpoints of the agent gateway: pairs (worker + data proxy) and their health.

| POST   /admin/pairs              | {"proxy_id", "address"} | 201: the pair's proxy joins the router |
| DELETE /admin/pairs/{proxy_id}   | —                       | 200; 404 if unknown                    |
| GET    /admin/pairs              | —                       | {"pairs": [worker JSON]}               |
| GET    /admin/workers            | —                       | {"workers": [worker JSON]}             |

Every pair's proxy is registered as kind AGENT under the model `agent` (made on first use).
"""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.responses import Response

from areal_gateway.admin import LIST_WORKERS, list_workers, worker_json
from areal_gateway.agent.common import AGENT_KIND, AGENT_MODEL, log
from areal_gateway.api import ERRORS, AdminKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.runtime import Gateway
from areal_gateway.schemas import AddedPair, AddPairRequest, PairList, RemovedPair
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import NotFound


async def _ensure_model(gw: Gateway) -> None:
    if any(m.name == AGENT_MODEL for m in await gw.router.list_models()):
        return
    await gw.router.register_model(
        router_pb2.ModelInfo(
            name=AGENT_MODEL, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=int(time.time())
        )
    )


router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["agent admin"])


@router.post("/admin/pairs", status_code=201, response_model=AddedPair)
async def add_pair(body: AddPairRequest, gw: GatewayDep, _: AdminKey) -> Response:
    """Register a pair's data proxy with the router (kind AGENT, model `agent`)."""
    proxy_id, address = body.proxy_id, body.address
    await _ensure_model(gw)
    await gw.router.register_proxy(
        router_pb2.ProxyInfo(proxy_id=proxy_id, address=address, model=AGENT_MODEL, kind=AGENT_KIND)
    )
    log.info("pair %s registered at %s", proxy_id, address)
    return json_response({"proxy_id": proxy_id, "address": address, "model": AGENT_MODEL}, 201)


@router.delete("/admin/pairs/{proxy_id}", response_model=RemovedPair)
async def remove_pair(proxy_id: str, gw: GatewayDep, _: AdminKey) -> Response:
    """Deregister a pair; 404 if unknown."""
    if not await gw.router.deregister_proxy(proxy_id):
        raise NotFound(f"pair {proxy_id!r} is not registered", code="pair_not_found")
    log.info("pair %s deregistered", proxy_id)
    return json_response({"proxy_id": proxy_id, "removed": True})


@router.get("/admin/pairs", response_model=PairList)
async def list_pairs(gw: GatewayDep, _: AdminKey) -> Response:
    """The pairs with their health and load."""
    proxies = await gw.router.list_proxies(AGENT_MODEL, AGENT_KIND)
    return json_response(
        {"pairs": [worker_json(p) for p in sorted(proxies, key=lambda p: p.proxy_id)]}
    )


router.add_api_route("/admin/workers", list_workers, **LIST_WORKERS)
