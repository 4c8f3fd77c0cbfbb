"""Generation control for trainers (admin key): pause, continue, set version, update weights;
and the graceful drain of one worker (retire).

Each applies to every inference proxy, to one model's (`model`), or to one worker
(`worker`: a proxy id), in parallel. Pause aborts in-flight generations at the engines;
the proxies resubmit them on continue, so clients see slower answers, never errors.
`update_weights` = pause -> engine loads `path` -> version + 1 (or `version`) -> continue.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body
from starlette.responses import Response

from areal_gateway.api import ERRORS, AdminKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.runtime import Gateway
from areal_gateway.schemas import (
    ControlResult,
    ControlTarget,
    RetiredWorker,
    RetireRequest,
    SetVersionRequest,
    UpdateWeightsRequest,
)
from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import Conflict, NotFound, ServiceError, UpstreamError

log = logging.getLogger(__name__)


async def _targets(gw: Gateway, target: ControlTarget) -> list[router_pb2.ProxyInfo]:
    model, worker = target.model or "", target.worker or ""
    proxies = [
        p
        for p in await gw.router.list_proxies(model=model)
        if p.kind in (router_pb2.PROXY_KIND_INFERENCE, router_pb2.PROXY_KIND_UNSPECIFIED)
    ]
    if worker:
        proxies = [p for p in proxies if p.proxy_id == worker]
        if not proxies:
            raise NotFound(f"No worker {worker!r}.", code="worker_not_found", param="worker")
    if not proxies:
        raise NotFound("No inference worker matches.", code="worker_not_found")
    return proxies


async def _apply(gw: Gateway, action: str, req: Any, target: ControlTarget) -> Response:
    """`action` on every matching proxy in parallel; 207 when only some succeeded."""
    proxies = await _targets(gw, target)
    timeout = gw.settings.request_timeout
    results = await asyncio.gather(
        *(gw.proxies.get(p.address).control(action, req, timeout) for p in proxies),
        return_exceptions=True,
    )
    workers: list[dict[str, Any]] = []
    failed: list[ServiceError] = []
    for p, r in zip(proxies, results, strict=True):
        if isinstance(r, BaseException):
            err = r if isinstance(r, ServiceError) else UpstreamError(str(r))
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
    if action in ("set_version", "update_weights"):
        await _tell_admission(gw, target, workers)
    body = {
        "action": action,
        "workers": workers,
        "version": max(versions) if versions else None,
    }
    status = 200 if not failed else (failed[0].http_status if len(failed) == len(workers) else 207)
    return json_response(body, status)


async def _tell_admission(
    gw: Gateway, target: ControlTarget, workers: list[dict[str, Any]]
) -> None:
    """The version every proxy of a model now stamps is the admission rule's version at
    once (the router's health polls would see it only within a poll interval, and a lower
    version, a trainer starting over, only as the highest the proxies report). Only when
    the call reached every proxy of the model: one worker, or a partial failure, is left to
    the polls. Best effort: a router error here does not fail the weight update that
    succeeded."""
    if target.worker:
        return
    by_model: dict[str, set[int]] = {}
    failed: set[str] = set()
    for w in workers:
        if "version" in w:
            by_model.setdefault(w["model"], set()).add(int(w["version"]))
        else:
            failed.add(w["model"])
    for model, versions in by_model.items():
        if model in failed or len(versions) != 1:
            continue
        (version,) = versions
        try:
            await gw.router.set_admission(model, version=version)
        except ServiceError as err:
            log.warning("admission: could not set %s's version %d: %s", model, version, err)


router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["control"])
# Pause and continue need no body (then: every inference proxy).
OptionalTarget = Annotated[ControlTarget, Body(default_factory=ControlTarget)]
# 207: some workers answered, some failed (each failed one has `error`).
_RESULT: dict[str, Any] = {
    "response_model": ControlResult,
    "responses": {207: {"model": ControlResult, "description": "only some workers succeeded"}},
}


@router.post("/admin/pause", **_RESULT)
async def pause(gw: GatewayDep, _: AdminKey, body: OptionalTarget) -> Response:
    """Abort in-flight generations at the engines; the proxies resubmit them on continue."""
    return await _apply(gw, "pause", proxy_pb2.PauseRequest(), body)


@router.post("/admin/continue", **_RESULT)
async def resume(gw: GatewayDep, _: AdminKey, body: OptionalTarget) -> Response:
    """Resume generation (paused requests continue from the tokens they had)."""
    return await _apply(gw, "continue", proxy_pb2.ContinueRequest(), body)


@router.post("/admin/set_version", **_RESULT)
async def set_version(body: SetVersionRequest, gw: GatewayDep, _: AdminKey) -> Response:
    """The weight version stamped on tokens from now on."""
    return await _apply(gw, "set_version", proxy_pb2.SetVersionRequest(version=body.version), body)


@router.post("/admin/update_weights", **_RESULT)
async def update_weights(body: UpdateWeightsRequest, gw: GatewayDep, _: AdminKey) -> Response:
    """pause -> the engines load `path` -> version + 1 (or `version`) -> continue."""
    req = proxy_pb2.UpdateWeightsRequest(path=body.path, version=body.version)
    return await _apply(gw, "update_weights", req, body)


# The drain itself is bounded by the request's drain_timeout; this is for what follows it
# (evacuated requests leaving the engine, the answer).
_RETIRE_SLACK_S = 30.0


@router.post("/admin/workers/{proxy_id}/retire", response_model=RetiredWorker)
async def retire(
    proxy_id: str,
    gw: GatewayDep,
    _: AdminKey,
    body: Annotated[RetireRequest, Body(default_factory=RetireRequest)],
) -> Response:
    """Graceful drain of one replica: no new work reaches its engine, the requests on it get
    `drain_timeout` seconds to finish, then move to another replica (token-preserving
    migration). Answers once nothing runs on the engine, which may then be stopped. The
    worker stays, serving the turns, rewards and exports of the sessions pinned to it on the
    other replicas' engines. Idempotent."""
    (proxy,) = await _targets(gw, ControlTarget(worker=proxy_id))
    if proxy.health != router_pb2.PROXY_HEALTH_DRAINING:
        # Retiring a retired worker again is a no-op (it reports draining); otherwise
        # another replica must be left to take the model's new work.
        await _refuse_last_replica(gw, proxy)
    client = gw.proxies.get(proxy.address)
    req = proxy_pb2.RetireRequest(drain_timeout_s=body.drain_timeout)
    out = await client.retire(req, body.drain_timeout + _RETIRE_SLACK_S)
    return json_response(
        {
            "proxy_id": proxy.proxy_id,
            "model": proxy.model,
            "finished": out.finished,
            "moved": out.moved,
            "failed": out.failed,
            "message": out.message,
        }
    )


async def _refuse_last_replica(gw: Gateway, proxy: router_pb2.ProxyInfo) -> None:
    """Refuse to retire the model's last serving replica, as `areal inf deregister --replica`
    does: once retired, nothing would generate for the model (every chat and new session a
    503) until a restart. A replica counts as serving unless it is retired or draining; one
    that is unhealthy for now still counts (it comes back, a retired one does not)."""
    peers = [
        p
        for p in await gw.router.list_proxies(model=proxy.model)
        if p.proxy_id != proxy.proxy_id
        and p.kind in (router_pb2.PROXY_KIND_INFERENCE, router_pb2.PROXY_KIND_UNSPECIFIED)
        and p.health != router_pb2.PROXY_HEALTH_DRAINING
    ]
    if not peers:
        raise Conflict(
            f"Worker {proxy.proxy_id!r} is the last serving replica of model {proxy.model!r}: "
            "no other replica could take its requests; deregister the model instead "
            f"(DELETE /admin/models/{proxy.model}, or `areal inf deregister --model-name "
            f"{proxy.model}`).",
            code="last_serving_replica",
            param="proxy_id",
        )
