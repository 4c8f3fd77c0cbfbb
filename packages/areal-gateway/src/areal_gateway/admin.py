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

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.auth import require_admin
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import parse_object, read_body
from areal_gateway.runtime import Gateway
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import ServiceError

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


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def _admin(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    require_admin(gw.auth.principal(request))
    return gw


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


def _str_field(doc: dict[str, Any], key: str, *, required: bool = True, where: str = "") -> str:
    value = doc.get(key)
    param = f"{where}{key}"
    if value is None:
        if required:
            raise bad_request(
                f"Missing required parameter: '{param}'.",
                code="missing_required_parameter",
                param=param,
            )
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise bad_request(
            f"'{param}' must be a non-empty string.", code="invalid_type", param=param
        )
    return value.strip()


def _address(doc: dict[str, Any], where: str) -> str:
    address = _str_field(doc, "address", where=where)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad_request(
            f"'{where}address' must be host:port, got {address!r}.",
            code="invalid_address",
            param=f"{where}address",
        )
    return address


def _proxy(doc: Any, model: str, where: str) -> router_pb2.ProxyInfo:
    if not isinstance(doc, dict):
        raise bad_request(f"'{where.rstrip('.')}' must be an object.", code="invalid_type")
    return router_pb2.ProxyInfo(
        proxy_id=_str_field(doc, "proxy_id", where=where),
        address=_address(doc, where),
        model=model,
        kind=router_pb2.PROXY_KIND_INFERENCE,
    )


async def _find_model(gw: Gateway, name: str) -> router_pb2.ModelInfo | None:
    for m in await gw.router.list_models():
        if m.name == name:
            return m
    return None


async def list_models(request: Request) -> Response:
    gw = await _admin(request)
    models = await gw.router.list_models()
    proxies = await gw.router.list_proxies()
    by_model: dict[str, list[router_pb2.ProxyInfo]] = {}
    for p in proxies:
        by_model.setdefault(p.model, []).append(p)
    return _json(
        {
            "models": [
                model_json(m, sorted(by_model.get(m.name, []), key=lambda p: p.proxy_id))
                for m in sorted(models, key=lambda m: m.name)
            ]
        }
    )


async def register_model(request: Request) -> Response:
    gw = await _admin(request)
    doc = parse_object(await read_body(request, gw.settings.max_body_bytes))
    name = _str_field(doc, "name")
    kind = doc.get("kind", "internal")
    if kind not in ("internal", "external"):
        raise bad_request(
            "'kind' must be 'internal' or 'external'.", code="invalid_value", param="kind"
        )
    if kind == "internal":
        raw = doc.get("proxies", [])
        if not isinstance(raw, list):
            raise bad_request("'proxies' must be an array.", code="invalid_type", param="proxies")
        proxies = [_proxy(p, name, f"proxies.{i}.") for i, p in enumerate(raw)]
        ids = [p.proxy_id for p in proxies]
        if len(set(ids)) != len(ids):
            raise bad_request(
                "proxy ids must be unique.", code="duplicate_proxy_id", param="proxies"
            )
    else:
        base_url = _str_field(doc, "base_url")
        api_key = _str_field(doc, "api_key", required=False)
        upstream = _str_field(doc, "upstream_model", required=False) or name
    if await _find_model(gw, name) is not None:
        raise ServiceError(
            409, f"Model {name!r} is already registered.", code="model_exists", param="name"
        )

    if kind == "external":
        url = await gw.external.validate(base_url, api_key)
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
        return _json(
            {"name": name, "kind": "external", "base_url": url, "upstream_model": upstream}, 201
        )

    info = router_pb2.ModelInfo(
        name=name, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=int(time.time())
    )
    await gw.router.register_model(info)
    try:
        for p in proxies:
            await gw.router.register_proxy(p)
    except ServiceError:
        # All or nothing: leave no half-registered model behind.
        try:
            await gw.router.deregister_model(name)
        except ServiceError as exc:
            log.warning("rollback of model %s failed: %s", name, exc.message)
        raise
    gw.catalog.remember(info)
    log.info("registered model %s with %d proxies", name, len(proxies))
    return _json(
        {
            "name": name,
            "kind": "internal",
            "proxies": [{"proxy_id": p.proxy_id, "address": p.address} for p in proxies],
        },
        201,
    )


async def deregister_model(request: Request) -> Response:
    name = request.path_params["name"]
    gw = await _admin(request)
    existed, proxy_ids = await gw.router.deregister_model(name)
    gw.catalog.forget(name)
    if not existed:
        raise ServiceError(
            404, f"Model {name!r} is not registered.", code="model_not_found", param="name"
        )
    log.info("deregistered model %s (proxies %s)", name, ", ".join(proxy_ids) or "none")
    return _json({"name": name, "proxy_ids": proxy_ids})


async def add_proxy(request: Request) -> Response:
    name = request.path_params["name"]
    gw = await _admin(request)
    doc = parse_object(await read_body(request, gw.settings.max_body_bytes))
    proxy = _proxy(doc, name, "")
    model = await _find_model(gw, name)
    if model is None:
        raise ServiceError(
            404, f"Model {name!r} is not registered.", code="model_not_found", param="name"
        )
    if model.kind == router_pb2.MODEL_KIND_EXTERNAL:
        raise bad_request(f"Model {name!r} is external; it has no proxies.", code="external_model")
    await gw.router.register_proxy(proxy)
    log.info("model %s: added proxy %s at %s", name, proxy.proxy_id, proxy.address)
    return _json({"name": name, "proxy_id": proxy.proxy_id, "address": proxy.address}, 201)


async def list_workers(request: Request) -> Response:
    gw = await _admin(request)
    proxies = await gw.router.list_proxies()
    return _json({"workers": [worker_json(p) for p in sorted(proxies, key=lambda p: p.proxy_id)]})


routes = [
    Route("/admin/models", list_models, methods=["GET"]),
    Route("/admin/models", register_model, methods=["POST"]),
    Route("/admin/models/{name}", deregister_model, methods=["DELETE"]),
    Route("/admin/models/{name}/proxies", add_proxy, methods=["POST"]),
    Route("/admin/workers", list_workers, methods=["GET"]),
]
