"""Session endpoints of the agent gateway.

| POST   /v1/sessions                 | admin        | 201 {session_id, session_api_key, rl_session_id?} |
| DELETE /v1/sessions/{id}            | admin or own | {session_id, closed}                             |
| GET    /v1/sessions/{id}/history    | admin or own | {session_id, history: [...]}                     |
| POST   /v1/sessions/{id}/reward     | admin or own | {session_id, interaction_id, reward} (linked)    |
| POST   /v1/sessions/{id}/export     | admin or own | {rows: [...]} (linked)                           |
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway.agent.common import (
    check_session_access,
    create_session,
    gateway,
    json_response,
    log,
    metadata_of,
    principal,
    proxy_of,
    release,
    require_admin,
    session_key_of,
)
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import parse_object, read_body
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.errors import SessionNotFound


def _envelope(p: Any, session_id: str, deadline_s: float) -> envelope_pb2.Envelope:
    return envelope_pb2.Envelope(
        request_id=os.urandom(12).hex(),
        api_key=p.api_key,
        session_id=session_id,
        is_admin=p.is_admin,
        deadline_unix_ms=int((time.time() + deadline_s) * 1000),
    )


async def _optional_body(request: Request, limit: int) -> dict[str, Any]:
    body = await read_body(request, limit)
    return parse_object(body) if body.strip() else {}


async def create(request: Request) -> Response:
    gw = gateway(request)
    require_admin(principal(gw, request))
    doc = await _optional_body(request, gw.settings.max_body_bytes)
    out = await create_session(gw, metadata_of(doc))
    return json_response(out, 201)


async def close(request: Request) -> Response:
    gw = gateway(request)
    sid = request.path_params["session_id"]
    p = principal(gw, request)
    check_session_access(p, sid)
    client = await proxy_of(gw, sid)
    existed = await client.close_session(sid, session_key_of(p))
    await release(gw, sid)
    if not existed:
        raise_not_found(sid)
    log.info("session %s closed", sid)
    return json_response({"session_id": sid, "closed": True})


def raise_not_found(sid: str) -> None:
    raise SessionNotFound(f"session '{sid}' not found")


async def history(request: Request) -> Response:
    gw = gateway(request)
    sid = request.path_params["session_id"]
    p = principal(gw, request)
    check_session_access(p, sid)
    client = await proxy_of(gw, sid)
    raw = await client.history(sid, session_key_of(p))
    return Response(
        b'{"session_id":' + orjson.dumps(sid) + b',"history":' + (raw or b"[]") + b"}",
        media_type="application/json",
    )


async def reward(request: Request) -> Response:
    gw = gateway(request)
    sid = request.path_params["session_id"]
    p = principal(gw, request)
    check_session_access(p, sid)
    doc = parse_object(await read_body(request, gw.settings.max_body_bytes))
    value = doc.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request("'reward' must be a finite number.", code="invalid_type", param="reward")
    interaction_id = doc.get("interaction_id") or ""
    if not isinstance(interaction_id, str):
        raise bad_request(
            "'interaction_id' must be a string.", code="invalid_type", param="interaction_id"
        )
    client = await proxy_of(gw, sid)
    resp = await client.set_reward(
        proxy_pb2.SetRewardRequest(
            session_id=sid,
            interaction_id=interaction_id,
            reward=float(value),
            envelope=_envelope(p, sid, 60.0),
        )
    )
    return json_response(
        {"session_id": sid, "interaction_id": resp.interaction_id, "reward": resp.reward}
    )


async def export(request: Request) -> Response:
    gw = gateway(request)
    sid = request.path_params["session_id"]
    p = principal(gw, request)
    check_session_access(p, sid)
    doc = await _optional_body(request, gw.settings.max_body_bytes)
    style = doc.get("style", "individual")
    if style not in ("individual", "concat"):
        raise bad_request(
            "'style' must be 'individual' or 'concat'.", code="invalid_value", param="style"
        )
    discount = doc.get("discount", 1.0)
    if isinstance(discount, bool) or not isinstance(discount, (int, float)):
        raise bad_request("'discount' must be a number.", code="invalid_type", param="discount")
    remove = doc.get("remove_session", False)
    if not isinstance(remove, bool):
        raise bad_request(
            "'remove_session' must be a boolean.", code="invalid_type", param="remove_session"
        )
    client = await proxy_of(gw, sid)
    timeout = gw.settings.request_timeout
    chunks = await client.export(
        proxy_pb2.ExportTrajectoriesRequest(
            session_ids=[sid],
            style=style,
            discount=float(discount),
            remove_session=remove,
            envelope=_envelope(p, sid, timeout),
        ),
        timeout,
    )
    rows = [line for chunk in chunks for line in chunk.splitlines() if line.strip()]
    return Response(b'{"rows":[' + b",".join(rows) + b"]}", media_type="application/json")


routes = [
    Route("/v1/sessions", create, methods=["POST"]),
    Route("/v1/sessions/{session_id}", close, methods=["DELETE"]),
    Route("/v1/sessions/{session_id}/history", history, methods=["GET"]),
    Route("/v1/sessions/{session_id}/reward", reward, methods=["POST"]),
    Route("/v1/sessions/{session_id}/export", export, methods=["POST"]),
]
