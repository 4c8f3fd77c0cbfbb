"""The admin API (docs/services.md, "Gateway admin API"); every endpoint needs the admin key.

| GET    /admin/models                  | models with their workers (health, load)          |
| POST   /admin/models                  | register internal (proxies) or external (URL)     |
| DELETE /admin/models/{name}           | deregister; 404 if unknown                        |
| POST   /admin/models/{name}/proxies   | one more replica                                  |
| GET    /admin/workers                 | every proxy the router knows                      |

The router holds the registry; the gateway validates input, checks external URLs, and never
returns an external model's key.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from areal_gateway.api import ERRORS, AdminKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.openai.errors import bad_request
from areal_gateway.runtime import Gateway
from areal_gateway.schemas import (
    AddedProxy,
    DeregisteredModel,
    ModelList,
    ProxyRef,
    RegisteredModel,
    RegisterModelRequest,
    WorkerList,
)
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import InternalAuthFailed, ModelExists, ServiceError, UnknownModel

log = logging.getLogger(__name__)

_HEALTH = {
    router_pb2.PROXY_HEALTH_UNSPECIFIED: "unknown",
    router_pb2.PROXY_HEALTH_HEALTHY: "healthy",
    router_pb2.PROXY_HEALTH_UNHEALTHY: "unhealthy",
    router_pb2.PROXY_HEALTH_DRAINING: "draining",
}
_PROXY_KIND = {
    router_pb2.PROXY_KIND_UNSPECIFIED: "unspecified",
    router_pb2.PROXY_KIND_INFERENCE: "inference",
    router_pb2.PROXY_KIND_AGENT: "agent",
}
_MODEL_KIND = {
    router_pb2.MODEL_KIND_UNSPECIFIED: "unspecified",
    router_pb2.MODEL_KIND_INTERNAL: "internal",
    router_pb2.MODEL_KIND_EXTERNAL: "external",
}


def worker_json(p: router_pb2.ProxyInfo) -> dict[str, Any]:
    return {
        "proxy_id": p.proxy_id,
        "address": p.address,
        "model": p.model,
        "kind": _PROXY_KIND.get(p.kind, "unspecified"),
        "health": _HEALTH.get(p.health, "unknown"),
        "inflight_requests": p.inflight_requests,
        "inflight_tokens": p.inflight_tokens,
        "sessions": p.sessions,
        "last_seen_unix_ms": p.last_seen_unix_ms,
        "last_error": p.last_error,
        "labels": dict(p.labels),
        "tool_call_parser": p.tool_call_parser,
        "reasoning_parser": p.reasoning_parser,
        "default_tool_prompt": p.default_tool_prompt,
    }


def _model_worker(p: router_pb2.ProxyInfo) -> dict[str, Any]:
    return {
        "proxy_id": p.proxy_id,
        "address": p.address,
        "health": _HEALTH.get(p.health, "unknown"),
        "inflight_requests": p.inflight_requests,
        "inflight_tokens": p.inflight_tokens,
        "sessions": p.sessions,
    }


def model_json(m: router_pb2.ModelInfo, workers: list[router_pb2.ProxyInfo]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": m.name,
        "kind": _MODEL_KIND.get(m.kind, "unspecified"),
        "created": m.created_unix_s,
    }
    if m.kind == router_pb2.MODEL_KIND_EXTERNAL:
        out["base_url"] = m.base_url
        out["upstream_model"] = m.upstream_model or m.name
    out["workers"] = [_model_worker(p) for p in workers]
    return out


def _proxy(ref: ProxyRef, model: str) -> router_pb2.ProxyInfo:
    return router_pb2.ProxyInfo(
        proxy_id=ref.proxy_id,
        address=ref.address,
        model=model,
        kind=router_pb2.PROXY_KIND_INFERENCE,
    )


async def _find_model(gw: Gateway, name: str) -> router_pb2.ModelInfo | None:
    for m in await gw.router.list_models():
        if m.name == name:
            return m
    return None


router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["admin"])


@router.get("/admin/models", response_model=ModelList)
async def list_models(gw: GatewayDep, _: AdminKey) -> Response:
    """Every model with its workers (health, load)."""
    models = await gw.router.list_models()
    proxies = await gw.router.list_proxies()
    by_model: dict[str, list[router_pb2.ProxyInfo]] = {}
    for p in proxies:
        by_model.setdefault(p.model, []).append(p)
    return json_response(
        {
            "models": [
                model_json(m, sorted(by_model.get(m.name, []), key=lambda p: p.proxy_id))
                for m in sorted(models, key=lambda m: m.name)
            ]
        }
    )


async def _register_proxies(gw: Gateway, proxies: list[router_pb2.ProxyInfo]) -> None:
    """Register every proxy in one router call, which answers once each has been polled.
    A proxy that refuses the service's internal token would take the registration and then
    fail every request: refused here, naming it (502 internal_auth_failed)."""
    # Each first poll is bounded by the router's poll timeout; a few seconds more for the
    # calls themselves at a thousand proxies.
    _, refused = await gw.router.register_proxies(proxies, timeout_s=30.0 + len(proxies) / 100)
    if refused:
        at = {p.proxy_id: p.address for p in proxies}
        named = ", ".join(f"{pid} at {at.get(pid, '?')}" for pid in refused[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        raise InternalAuthFailed(
            f"proxy {named}{more} refused this service's internal token (internal "
            "authentication failed: AREAL_INTERNAL_TOKEN differs between them)"
        )


@router.post("/admin/models", status_code=201, response_model=RegisteredModel)
async def register_model(body: RegisterModelRequest, gw: GatewayDep, _: AdminKey) -> Response:
    """Register an internal model (its proxies) or an external one (its URL, checked with
    `GET {base_url}/models`); 409 if the name exists."""
    name = body.name
    if body.kind == "external" and body.base_url is None:
        # Required for one kind only, so the model cannot say it.
        raise bad_request(
            "Missing required parameter: 'base_url'.",
            code="missing_required_parameter",
            param="base_url",
        )
    if body.kind == "internal" and not body.proxies:
        # A model nothing serves would only answer 503s, and count as a model for
        # /rl/start_session's choice when `model` is omitted.
        raise bad_request(
            "An internal model needs at least one proxy in 'proxies'.",
            code="missing_required_parameter",
            param="proxies",
        )
    if await _find_model(gw, name) is not None:
        raise ModelExists(f"Model {name!r} is already registered.", param="name")

    if body.kind == "external":
        assert body.base_url is not None
        api_key = body.api_key or ""
        upstream = body.upstream_model or name
        url = await gw.external.validate(body.base_url, api_key)
        info = router_pb2.ModelInfo(
            name=name,
            kind=router_pb2.MODEL_KIND_EXTERNAL,
            base_url=url,
            api_key=api_key,
            upstream_model=upstream,
            created_unix_s=int(time.time()),
        )
        await gw.router.register_model(info)
        gw.catalog.remember(info)
        log.info("registered external model %s -> %s (%s)", name, url, upstream)
        return json_response(
            {"name": name, "kind": "external", "base_url": url, "upstream_model": upstream}, 201
        )

    proxies = [_proxy(p, name) for p in body.proxies]
    info = router_pb2.ModelInfo(
        name=name, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=int(time.time())
    )
    await gw.router.register_model(info)
    try:
        await _register_proxies(gw, proxies)
    except ServiceError:
        # All or nothing: leave no half-registered model behind.
        try:
            await gw.router.deregister_model(name)
        except ServiceError as exc:
            log.warning("rollback of model %s failed: %s", name, exc.message)
        raise
    gw.catalog.remember(info)
    log.info("registered model %s with %d proxies", name, len(proxies))
    return json_response(
        {
            "name": name,
            "kind": "internal",
            "proxies": [{"proxy_id": p.proxy_id, "address": p.address} for p in proxies],
        },
        201,
    )


@router.delete("/admin/models/{name}", response_model=DeregisteredModel)
async def deregister_model(name: str, gw: GatewayDep, _: AdminKey) -> Response:
    """Deregister a model and its proxies; 404 if unknown."""
    existed, proxy_ids = await gw.router.deregister_model(name)
    gw.catalog.forget(name)
    if not existed:
        raise UnknownModel(f"Model {name!r} is not registered.", param="name")
    log.info("deregistered model %s (proxies %s)", name, ", ".join(proxy_ids) or "none")
    return json_response({"name": name, "proxy_ids": proxy_ids})


@router.post("/admin/models/{name}/proxies", status_code=201, response_model=AddedProxy)
async def add_proxy(name: str, body: ProxyRef, gw: GatewayDep, _: AdminKey) -> Response:
    """One more replica of an internal model."""
    proxy = _proxy(body, name)
    model = await _find_model(gw, name)
    if model is None:
        raise UnknownModel(f"Model {name!r} is not registered.", param="name")
    if model.kind == router_pb2.MODEL_KIND_EXTERNAL:
        raise bad_request(f"Model {name!r} is external; it has no proxies.", code="external_model")
    await gw.proxies.get(proxy.address).check_token()
    await gw.router.register_proxy(proxy)
    log.info("model %s: added proxy %s at %s", name, proxy.proxy_id, proxy.address)
    return json_response({"name": name, "proxy_id": proxy.proxy_id, "address": proxy.address}, 201)


async def list_workers(gw: GatewayDep, _: AdminKey) -> Response:
    """Every proxy the router knows (also served in agent mode)."""
    proxies = await gw.router.list_proxies()
    return json_response(
        {"workers": [worker_json(p) for p in sorted(proxies, key=lambda p: p.proxy_id)]}
    )


LIST_WORKERS: dict[str, Any] = {"methods": ["GET"], "response_model": WorkerList}
router.add_api_route("/admin/workers", list_workers, **LIST_WORKERS)
