"""The RL API: sessions, rewards, trajectories (docs/services.md, docs/architecture.md).

| POST /rl/start_session       | admin key   | a group of sessions on one proxy, placed by load     |
| POST /rl/set_reward          | session key | reward its session's last (or a named) interaction   |
| POST /rl/export_trajectories | admin key, or a session key for its own session          |
| POST /rl/end_session         | session key (its own) or admin key (`session_ids`)        |

A group is pinned on the router under the id `group:<group_id>` beside its sessions,
so an export by group goes straight to the proxy that holds it. The gateway keeps no
session state: a session key names its session and the proxy checks the key's hash.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from areal_gateway.auth import Principal, require_admin
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import parse_object, read_body, request_id
from areal_gateway.runtime import Gateway
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import ServiceError
from areal_runtime.session_keys import mint_key, new_id

MAX_GROUP_SIZE = 1024
_NDJSON = "application/x-ndjson"


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def group_pin(group_id: str) -> str:
    return f"group:{group_id}"


def _envelope(p: Principal, request: Request) -> envelope_pb2.Envelope:
    return envelope_pb2.Envelope(
        request_id=request_id(request),
        api_key=p.api_key,
        session_id=p.session_id,
        is_admin=p.is_admin,
    )


async def _body(request: Request) -> tuple[Gateway, Principal, dict[str, Any]]:
    gw: Gateway = request.app.state.gateway
    principal = gw.auth.principal(request)
    raw = await read_body(request, gw.settings.max_body_bytes)
    return gw, principal, (parse_object(raw) if raw else {})


def _number(doc: dict[str, Any], key: str, default: float | None = None) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number.", code="invalid_type", param=key)
    return float(value)


def _string(doc: dict[str, Any], key: str, default: str = "") -> str:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string.", code="invalid_type", param=key)
    return value


def _string_list(doc: dict[str, Any], key: str) -> list[str]:
    value = doc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"'{key}' must be a list of ids.", code="invalid_type", param=key)
    return value


async def _where(gw: Gateway, session_or_pin: str) -> str:
    """Address of the proxy holding a session (or a group pin)."""
    route = await gw.router.route("", session_id=session_or_pin)
    if not route.address:
        raise ServiceError(
            503, f"no healthy proxy holds {session_or_pin!r}", code="no_healthy_replica"
        )
    return route.address


async def _pick_model(gw: Gateway, doc: dict[str, Any]) -> str:
    model = _string(doc, "model")
    internal = [
        m.name for m in await gw.router.list_models() if m.kind != router_pb2.MODEL_KIND_EXTERNAL
    ]
    if model:
        if model not in internal:
            raise ServiceError(
                404, f"Model {model!r} is not served here.", code="model_not_found", param="model"
            )
        return model
    if len(internal) == 1:
        return internal[0]
    if not internal:
        raise ServiceError(503, "No model is registered yet.", code="no_model")
    raise bad_request(
        f"Several models are served ({', '.join(sorted(internal))}); name one in 'model'.",
        code="model_required",
        param="model",
    )


async def start_session(request: Request) -> Response:
    gw, principal, doc = await _body(request)
    require_admin(principal)
    task_id = _string(doc, "task_id")
    size = doc.get("group_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_GROUP_SIZE:
        raise bad_request(
            f"'group_size' must be an integer from 1 to {MAX_GROUP_SIZE}.",
            code="invalid_value",
            param="group_size",
        )
    model = await _pick_model(gw, doc)
    group_id = new_id("group")
    creds = []
    for _ in range(size):
        sid = new_id("sess")
        creds.append(proxy_pb2.SessionCredentials(session_id=sid, session_api_key=mint_key(sid)))
    ids = [c.session_id for c in creds]
    bound = await gw.router.bind_sessions([group_pin(group_id), *ids], model)
    try:
        await gw.proxies.get(bound.address).start_sessions(
            proxy_pb2.StartSessionsRequest(
                task_id=task_id, group_id=group_id, sessions=creds, model=model
            )
        )
    except ServiceError:
        await gw.router.release_sessions([group_pin(group_id), *ids])
        raise
    return _json(
        {
            "group_id": group_id,
            "task_id": task_id,
            "model": model,
            "sessions": [
                {"session_id": c.session_id, "session_api_key": c.session_api_key} for c in creds
            ],
        },
        201,
    )


def _session_target(principal: Principal, doc: dict[str, Any]) -> str:
    if principal.session_id:
        named = _string(doc, "session_id")
        if named and named != principal.session_id:
            raise ServiceError(
                403, "A session key may act only on its own session.", code="forbidden_session"
            )
        return principal.session_id
    sid = _string(doc, "session_id")
    if not sid:
        raise bad_request(
            "With the admin key, name the session in 'session_id'.", param="session_id"
        )
    return sid


async def set_reward(request: Request) -> Response:
    gw, principal, doc = await _body(request)
    sid = _session_target(principal, doc)
    if "reward" not in doc:
        raise bad_request(
            "Missing required parameter: 'reward'.",
            code="missing_required_parameter",
            param="reward",
        )
    reward = _number(doc, "reward")
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise bad_request("'reward' must be a finite number.", code="invalid_value", param="reward")
    address = await _where(gw, sid)
    out = await gw.proxies.get(address).set_reward(
        proxy_pb2.SetRewardRequest(
            session_id=sid,
            interaction_id=_string(doc, "interaction_id"),
            reward=reward,
            envelope=_envelope(principal, request),
        )
    )
    return _json({"session_id": sid, "interaction_id": out.interaction_id, "reward": out.reward})


async def end_session(request: Request) -> Response:
    gw, principal, doc = await _body(request)
    ids = [principal.session_id] if principal.session_id else _string_list(doc, "session_ids")
    if not ids:
        raise bad_request(
            "With the admin key, list the sessions in 'session_ids'.", param="session_ids"
        )
    ended = 0
    for sid in ids:
        address = await _where(gw, sid)
        ended += await gw.proxies.get(address).end_sessions(
            proxy_pb2.EndSessionsRequest(session_ids=[sid], envelope=_envelope(principal, request))
        )
    return _json({"ended": ended})


async def export_trajectories(request: Request) -> Response:
    gw, principal, doc = await _body(request)
    group_id = _string(doc, "group_id")
    session_ids = _string_list(doc, "session_ids")
    style = _string(doc, "style", "individual")
    if style not in ("individual", "concat"):
        raise bad_request(
            "'style' must be 'individual' or 'concat'.", code="invalid_value", param="style"
        )
    discount = _number(doc, "discount", 1.0)
    if not 0.0 <= discount <= 1.0:
        raise bad_request(
            "'discount' must be between 0 and 1.", code="invalid_value", param="discount"
        )
    remove = doc.get("remove_session", False)
    if not isinstance(remove, bool):
        raise bad_request(
            "'remove_session' must be a boolean.", code="invalid_type", param="remove_session"
        )
    if principal.session_id:
        if group_id or any(s != principal.session_id for s in session_ids):
            raise ServiceError(
                403, "A session key may export only its own session.", code="forbidden_session"
            )
        session_ids = [principal.session_id]
    elif not group_id and not session_ids:
        raise bad_request(
            "Give 'group_id' or 'session_ids'.",
            code="missing_required_parameter",
            param="session_ids",
        )
    # Which proxy holds what: a group lives on one proxy; sessions may be spread.
    targets: dict[str, list[str]] = {}
    if group_id:
        targets[await _where(gw, group_pin(group_id))] = session_ids
    else:
        for sid in session_ids:
            targets.setdefault(await _where(gw, sid), []).append(sid)
    env = _envelope(principal, request)
    timeout = gw.settings.request_timeout

    def export_call(address: str, ids: list[str]) -> AsyncIterator[bytes]:
        return gw.proxies.get(address).export(
            proxy_pb2.ExportTrajectoriesRequest(
                session_ids=ids,
                group_id=group_id,
                style=style,
                discount=discount,
                remove_session=remove,
                envelope=env,
            ),
            timeout,
        )

    async def released() -> None:
        if remove:
            pins = [*session_ids, *([group_pin(group_id)] if group_id else [])]
            if pins:
                await gw.router.release_sessions(pins)

    wants_lines = doc.get("format") == "jsonl" or _NDJSON in request.headers.get("accept", "")
    if not wants_lines:
        # One JSON document: every chunk is read before anything is sent, so an error
        # anywhere is a plain error response.
        parts = [
            chunk for address, ids in targets.items() async for chunk in export_call(address, ids)
        ]
        body = b"".join(parts)
        await released()
        count = body.count(b"\n")
        return Response(
            b'{"count":'
            + str(count).encode()
            + b',"rows":['
            + b",".join(body.splitlines())
            + b"]}",
            media_type="application/json",
        )
    first_address, first_ids = next(iter(targets.items()))
    first_chunks = export_call(first_address, first_ids)
    # Pull the first chunk now, so that a bad group or key is an ordinary error response.
    try:
        head = await first_chunks.__anext__()
    except StopAsyncIteration:
        head = b""

    async def lines() -> AsyncIterator[bytes]:
        try:
            if head:
                yield head
            async for chunk in first_chunks:
                yield chunk
            for address, ids in list(targets.items())[1:]:
                async for chunk in export_call(address, ids):
                    yield chunk
            await released()
        except ServiceError as err:
            yield orjson.dumps(err.to_openai()) + b"\n"

    return StreamingResponse(lines(), media_type=_NDJSON)


routes = [
    Route("/rl/start_session", start_session, methods=["POST"]),
    Route("/rl/set_reward", set_reward, methods=["POST"]),
    Route("/rl/end_session", end_session, methods=["POST"]),
    Route("/rl/export_trajectories", export_trajectories, methods=["POST"]),
    # Upstream's path, so existing trainers work unchanged.
    Route("/export_trajectories", export_trajectories, methods=["POST"]),
]
