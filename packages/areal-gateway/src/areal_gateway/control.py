"""Generation control for trainers (admin key): pause, continue, set version, update weights.

Each applies to every inference proxy, to one model's (`model`), or to one worker
(`worker`: a proxy id), in parallel. Pause aborts in-flight generations at the engines;
the proxies resubmit them on continue, so clients see slower answers, never errors.
`update_weights` = pause -> engine loads `path` -> version + 1 (or `version`) -> continue.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.auth import require_admin
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import parse_object, read_body
from areal_gateway.runtime import Gateway
from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import ServiceError


async def _targets(gw: Gateway, doc: dict[str, Any]) -> list[router_pb2.ProxyInfo]:
    model, worker = doc.get("model") or "", doc.get("worker") or ""
    if not isinstance(model, str) or not isinstance(worker, str):
        raise bad_request("'model' and 'worker' must be strings.", code="invalid_type")
    proxies = [
        p
        for p in await gw.router.list_proxies(model=model)
        if p.kind in (router_pb2.PROXY_KIND_INFERENCE, router_pb2.PROXY_KIND_UNSPECIFIED)
    ]
    if worker:
        proxies = [p for p in proxies if p.proxy_id == worker]
        if not proxies:
            raise ServiceError(
                404, f"No worker {worker!r}.", code="worker_not_found", param="worker"
            )
    if not proxies:
        raise ServiceError(404, "No inference worker matches.", code="worker_not_found")
    return proxies


def _request(action: str, doc: dict[str, Any]) -> Any:
    if action == "pause":
        return proxy_pb2.PauseRequest()
    if action == "continue":
        return proxy_pb2.ContinueRequest()
    version = doc.get("version", -1 if action == "update_weights" else None)
    if isinstance(version, bool) or not isinstance(version, int):
        raise bad_request("'version' must be an integer.", code="invalid_type", param="version")
    if action == "set_version":
        if version < 0:
            raise bad_request("'version' must be >= 0.", code="invalid_value", param="version")
        return proxy_pb2.SetVersionRequest(version=version)
    path = doc.get("path")
    if not isinstance(path, str) or not path:
        raise bad_request(
            "Missing required parameter: 'path'.", code="missing_required_parameter", param="path"
        )
    return proxy_pb2.UpdateWeightsRequest(path=path, version=version)


def _endpoint(action: str):  # type: ignore[no-untyped-def]
    async def handle(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        require_admin(gw.auth.principal(request))
        raw = await read_body(request, gw.settings.max_body_bytes)
        doc = parse_object(raw) if raw.strip() else {}
        req = _request(action, doc)
        proxies = await _targets(gw, doc)
        timeout = gw.settings.request_timeout
        results = await asyncio.gather(
            *(gw.proxies.get(p.address).control(action, req, timeout) for p in proxies),
            return_exceptions=True,
        )
        workers: list[dict[str, Any]] = []
        failed: list[ServiceError] = []
        for p, r in zip(proxies, results, strict=True):
            if isinstance(r, BaseException):
                err = r if isinstance(r, ServiceError) else ServiceError(502, str(r))
                failed.append(err)
                workers.append({"proxy_id": p.proxy_id, "model": p.model, "error": err.message})
            else:
                workers.append(
                    {
                        "proxy_id": p.proxy_id,
                        "model": p.model,
                        "paused": r.paused,
                        "version": r.version,
                        "message": r.message,
                    }
                )
        versions = [w["version"] for w in workers if "version" in w]
        body = {
            "action": action,
            "workers": workers,
            "version": max(versions) if versions else None,
        }
        status = (
            200 if not failed else (failed[0].http_status if len(failed) == len(workers) else 207)
        )
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    return handle


routes = [
    Route(f"/admin/{action}", _endpoint(action), methods=["POST"])
    for action in ("pause", "continue", "set_version", "update_weights")
]
