"""The RL API: sessions, rewards, trajectories (docs/services.md, docs/architecture.md).

| POST /rl/start_session       | admin key   | a group of sessions on one proxy, placed by load,    |
|                              |             | once the model's admission bounds admit it (wait_s)  |
| POST /rl/set_reward          | session key | reward its session's last (or a named) interaction   |
| POST /rl/export_trajectories | admin key, or a session key for its own session          |
| POST /rl/end_session         | session key (its own) or admin key (`session_ids`)        |
| POST /rl/ack_export          | the export's key: removes what an export with removal read |
| GET /rl/sessions/{id}        | admin key, or a session key for its own session (ended too) |

A group is pinned on the router under the id `group:<group_id>` beside its sessions,
so an export by group goes straight to the proxy that holds it. The gateway keeps no
session state: a session key names its session and carries a MAC the gateway checks before
routing (auth.py), and the proxy checks the key's hash.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from areal_gateway.api import ERRORS, AdminKey, AnyKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.auth import Principal
from areal_gateway.openai.errors import bad_request
from areal_gateway.openai.forward import request_id
from areal_gateway.runtime import Gateway
from areal_gateway.schemas import (
    MAX_GROUP_SIZE,
    AckExportRequest,
    AckExportResult,
    EndedSessions,
    EndSessionRequest,
    ExportRequest,
    ExportResult,
    RewardResult,
    SessionStatus,
    SetRewardRequest,
    StartedGroup,
    StartSessionRequest,
)
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2
from areal_runtime import tracing
from areal_runtime.errors import (
    NoHealthyReplica,
    PermissionDenied,
    ServiceError,
    SessionNotFound,
    Unavailable,
    UnknownModel,
)
from areal_runtime.session_keys import new_id

__all__ = ["EXPORT_ID_HEADER", "MAX_GROUP_SIZE", "export_routes", "group_pin", "router"]
_NDJSON = "application/x-ndjson"
# An NDJSON export with removal names its export id here (the body is only rows).
EXPORT_ID_HEADER = "x-areal-export-id"
# Far above any real export (one id per proxy of it): a bound on what an ack makes us route.
_MAX_EXPORT_ROUTES = 256


def group_pin(group_id: str) -> str:
    return f"group:{group_id}"


def new_export_id(routes: list[str]) -> str:
    """An export with removal's id: random, then the ids to route its ack by, one per proxy
    of the export (a group pin or a session id), so that the gateway, which keeps no state,
    can find every proxy that claimed a part of it. Nothing in it is trusted: the ack is
    routed like any request naming those ids, and a proxy removes only what it claimed under
    the whole id."""
    tail = base64.urlsafe_b64encode(orjson.dumps(routes)).rstrip(b"=").decode("ascii")
    return f"{new_id('exp')}.{tail}"


def export_routes(export_id: str) -> list[str]:
    """The route ids in an export id; a 400 for anything that is not one."""
    head, _, tail = export_id.partition(".")
    try:
        routes = orjson.loads(base64.urlsafe_b64decode(tail + "=" * (-len(tail) % 4)))
    except ValueError:
        routes = None
    if (
        not head.startswith("exp-")
        or not isinstance(routes, list)
        or not 0 < len(routes) <= _MAX_EXPORT_ROUTES
        or not all(isinstance(r, str) and r for r in routes)
    ):
        raise bad_request(
            "Not an export id (the export_id of an export with remove_session).",
            code="invalid_export_id",
            param="export_id",
        )
    return routes


def merged_summary(parts: list[bytes]) -> dict[str, Any]:
    """One export's summary from its proxies' (each counted its own rows)."""
    out: dict[str, Any] = {}
    for part in parts:
        doc = orjson.loads(part)
        for key, value in doc.items():
            if key == "version":
                out[key] = max(out.get(key, value), value)
            elif key == "failed":
                out.setdefault(key, []).extend(value)
            elif key == "staleness":
                hist = out.setdefault(key, {})
                for k, n in value.items():
                    hist[k] = hist.get(k, 0) + n
            else:
                out[key] = out.get(key, 0) + value
    if "staleness" in out:
        out["staleness"] = dict(sorted(out["staleness"].items(), key=lambda kv: int(kv[0])))
    return out


def _envelope(p: Principal, request: Request) -> envelope_pb2.Envelope:
    return envelope_pb2.Envelope(
        request_id=request_id(request),
        api_key=p.api_key,
        session_id=p.session_id,
        is_admin=p.is_admin,
    )


async def _where(gw: Gateway, session_or_pin: str) -> str:
    """Address of the proxy holding a session (or a group pin)."""
    route = await gw.router.route("", session_id=session_or_pin)
    if not route.address:
        raise NoHealthyReplica(f"no healthy proxy holds {session_or_pin!r}")
    return route.address


async def _pick_model(gw: Gateway, model: str) -> str:
    """The model a group is for: the one named, else the one internal model with replicas.

    Models without a proxy do not count when `model` is omitted: one (left by an older
    gateway, or emptied by deregistering its proxies) would otherwise make every
    session start without `model` a 400 "several models"."""
    listed = await gw.router.list_models(patient=True)
    models = [m for m in listed if m.kind != router_pb2.MODEL_KIND_EXTERNAL]
    internal = [m.name for m in models]
    if model:
        if model not in internal:
            raise UnknownModel(f"Model {model!r} is not served here.", param="model")
        return model
    served = [m.name for m in models if m.proxy_ids]
    if len(served) == 1:
        return served[0]
    if not internal:
        raise Unavailable("No model is registered yet.", code="no_model")
    if not served:
        raise NoHealthyReplica(
            f"No model has a replica yet ({', '.join(sorted(internal))}).",
            code="no_healthy_replica",
        )
    internal = served
    raise bad_request(
        f"Several models are served ({', '.join(sorted(internal))}); name one in 'model'.",
        code="model_required",
        param="model",
    )


router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["rl"])


@router.post("/rl/start_session", status_code=201, response_model=StartedGroup)
async def start_session(
    request: Request,
    gw: GatewayDep,
    _: AdminKey,
    body: Annotated[StartSessionRequest, Body(default_factory=StartSessionRequest)],
) -> Response:
    """A group of sessions, pinned together to one proxy chosen by load; each session gets
    its own key. `model` may be omitted when one model is served (several: 400). Under the
    model's admission bounds (docs/services.md, "Admission") the group's n sessions start only
    while they fit: else 429 with Retry-After, after waiting up to `wait_s` for room."""
    task_id = body.task_id or ""
    size = body.group_size
    model = await _pick_model(gw, body.model or "")
    group_id = new_id("group")
    creds = []
    for _i in range(size):
        sid = new_id("sess")
        key = gw.auth.mint_session_key(sid)
        creds.append(proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key))
    ids = [c.session_id for c in creds]
    with tracing.span(
        "gateway.start_session",
        kind=tracing.SERVER,
        parent=tracing.parent_from_headers(request.scope["headers"]),
        group_id=group_id,
        model=model,
        sessions=size,
    ):
        # The router admits the group's sessions (the samples; not the group pin) and pins
        # them in one step, so concurrent starts through any gateway never overshoot.
        bound = await gw.router.bind_sessions(
            [group_pin(group_id), *ids], model, admit=ids, wait_s=body.wait_s
        )
        try:
            await gw.proxies.get(bound.address).start_sessions(
                proxy_pb2.StartSessionsRequest(
                    task_id=task_id, group_id=group_id, sessions=creds, model=model
                )
            )
        except ServiceError:
            await gw.router.release_sessions([group_pin(group_id), *ids])
            raise
    return json_response(
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


def _session_target(principal: Principal, named: str) -> str:
    if principal.session_id:
        if named and named != principal.session_id:
            raise PermissionDenied(
                "A session key may act only on its own session.", code="forbidden_session"
            )
        return principal.session_id
    if not named:
        raise bad_request(
            "With the admin key, name the session in 'session_id'.", param="session_id"
        )
    return named


@router.post("/rl/set_reward", response_model=RewardResult)
async def set_reward(
    body: SetRewardRequest, request: Request, gw: GatewayDep, principal: AnyKey
) -> Response:
    """Reward its session's last interaction, or `interaction_id` (session key; the admin
    key names the session)."""
    sid = _session_target(principal, body.session_id or "")
    reward = body.reward
    address = await _where(gw, sid)
    out = await gw.proxies.get(address).set_reward(
        proxy_pb2.SetRewardRequest(
            session_id=sid,
            interaction_id=body.interaction_id or "",
            reward=reward,
            envelope=_envelope(principal, request),
        )
    )
    return json_response(
        {"session_id": sid, "interaction_id": out.interaction_id, "reward": out.reward}
    )


@router.get("/rl/sessions/{session_id}", response_model=SessionStatus)
async def session_status(
    session_id: str, request: Request, gw: GatewayDep, principal: AnyKey
) -> Response:
    """A session's status: its turns, and how their chat prompts were built (continued from
    the previous turn's, or whole, and why). The admin key reads any session; a session key
    only its own, ended too."""
    sid = _session_target(principal, session_id)
    address = await _where(gw, sid)
    status = await gw.proxies.get(address).session_status(
        proxy_pb2.GetSessionRequest(session_id=sid, envelope=_envelope(principal, request))
    )
    return json_response(status)


@router.post("/rl/end_session", response_model=EndedSessions)
async def end_session(
    request: Request,
    gw: GatewayDep,
    principal: AnyKey,
    body: Annotated[EndSessionRequest, Body(default_factory=EndSessionRequest)],
) -> Response:
    """End a session (its own key) or sessions (the admin key lists them); `failure` says
    they failed, and why (export group policies count them as failed)."""
    ids = [principal.session_id] if principal.session_id else (body.session_ids or [])
    if not ids:
        raise bad_request(
            "With the admin key, list the sessions in 'session_ids'.", param="session_ids"
        )
    ended = 0
    for sid in ids:
        address = await _where(gw, sid)
        ended += await gw.proxies.get(address).end_sessions(
            proxy_pb2.EndSessionsRequest(
                session_ids=[sid],
                envelope=_envelope(principal, request),
                failure=body.failure or "",
            )
        )
    # Ended sessions no longer generate: they leave the concurrency bound (not the staleness
    # bound: their samples are not yet consumed). Idempotent, like the end itself.
    await gw.router.end_admitted(ids)
    return json_response({"ended": ended})


async def export_trajectories(
    request: Request,
    gw: GatewayDep,
    principal: AnyKey,
    body: Annotated[ExportRequest, Body(default_factory=ExportRequest)],
) -> Response:
    """A group's or some sessions' trajectory rows (the admin key, or a session key for its
    own session): one JSON document, or JSON lines with `Accept: application/x-ndjson`.
    With `remove_session`, nothing is removed yet: the answer names an `export_id` (in the
    body, or the `X-Areal-Export-Id` header for JSON lines), and `POST /rl/ack_export` with
    it, once the client has every row, removes the sessions."""
    group_id = body.group_id or ""
    session_ids = body.session_ids or []
    style = body.style or "concat"
    side_calls = body.side_calls or "include"
    discount = body.discount
    remove = body.remove_session
    # Staleness bound and group policies: unset fields keep every row, as before.
    selection: dict[str, Any] = {
        "stale": body.stale or "drop",
        "mask_stale_tokens": body.mask_stale_tokens,
        "drop_incomplete_group": body.drop_incomplete_group,
        "min_usable_group_size": body.min_usable_group_size,
    }
    if body.max_staleness is not None:
        selection["max_staleness"] = body.max_staleness
    if principal.session_id:
        if group_id or any(s != principal.session_id for s in session_ids):
            raise PermissionDenied(
                "A session key may export only its own session.", code="forbidden_session"
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
    # Removal is two-phase: each proxy only claims what it exported under this id, and the
    # client's ack removes it. Removing here lost rows whenever the client did not get the
    # whole answer: a later proxy of the export failed after an earlier one had deleted, or
    # the client went away mid-stream (the gateway cannot know what it received).
    export_id = ""
    if remove:
        routes = [group_pin(group_id)] if group_id else [ids[0] for ids in targets.values()]
        export_id = new_export_id(routes)

    summaries: list[bytes] = []

    def export_call(address: str, ids: list[str]) -> AsyncIterator[bytes]:
        return gw.proxies.get(address).export(
            proxy_pb2.ExportTrajectoriesRequest(
                session_ids=ids,
                group_id=group_id,
                style=style,
                side_calls=side_calls,
                discount=discount,
                remove_session=remove,
                envelope=env,
                export_id=export_id,
                **selection,
            ),
            timeout,
            summaries,
        )

    wants_lines = body.format == "jsonl" or _NDJSON in request.headers.get("accept", "")
    if not wants_lines:
        # One JSON document: every chunk is read before anything is sent, so an error
        # anywhere is a plain error response.
        parts = [
            chunk for address, ids in targets.items() async for chunk in export_call(address, ids)
        ]
        data = b"".join(parts)
        count = data.count(b"\n")
        tail = b',"export_id":' + orjson.dumps(export_id) if export_id else b""
        if summaries:
            tail += b',"summary":' + orjson.dumps(merged_summary(summaries))
        return Response(
            b'{"count":'
            + str(count).encode()
            + b',"rows":['
            + b",".join(data.splitlines())
            + b"]"
            + tail
            + b"}",
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
        except ServiceError as err:
            yield orjson.dumps(err.to_openai()) + b"\n"

    headers = {EXPORT_ID_HEADER: export_id} if export_id else None
    return StreamingResponse(lines(), media_type=_NDJSON, headers=headers)


@router.post("/rl/ack_export", response_model=AckExportResult)
async def ack_export(
    body: AckExportRequest, request: Request, gw: GatewayDep, principal: AnyKey
) -> Response:
    """The client has every row of an export with `remove_session`: remove its sessions
    (with the key that exported; a session key removes only its own session). A session that
    gained a turn or a reward after the export read it is kept (`kept`), as is everything a
    newer export claimed since. Idempotent: again, it removes nothing more."""
    export_id = body.export_id
    routes = export_routes(export_id)
    if principal.session_id and any(r != principal.session_id for r in routes):
        raise PermissionDenied(
            "A session key may acknowledge only its own session's export.",
            code="forbidden_session",
        )
    env = _envelope(principal, request)
    removed: list[str] = []
    kept: list[str] = []
    emptied: list[str] = []
    for route in routes:
        try:
            address = await _where(gw, route)
        except SessionNotFound:
            # No pin: it was released with the sessions it placed (an ack answered before,
            # whose answer was lost), so nothing of this export is left to find there.
            continue
        out = await gw.proxies.get(address).ack_export(
            proxy_pb2.AckExportRequest(export_id=export_id, envelope=env)
        )
        removed += out.removed_session_ids
        kept += out.kept_session_ids
        emptied += out.emptied_group_ids
    # Pins go only with what is really gone: the removed sessions, and a group's pin (with
    # the sessions bound with it) once its last session is.
    pins = [*removed, *(group_pin(g) for g in emptied)]
    if pins:
        # Exported and acknowledged: admission control counts them as consumed.
        await gw.router.release_sessions(pins, with_bound=bool(emptied), consumed=True)
    return json_response({"export_id": export_id, "removed": removed, "kept": kept})


_EXPORT: dict[str, Any] = {
    "methods": ["POST"],
    "response_model": ExportResult,
    "responses": {
        200: {"content": {_NDJSON: {"schema": {"description": "one trajectory row per line"}}}}
    },
}
router.add_api_route("/rl/export_trajectories", export_trajectories, **_EXPORT)
# Upstream's path, so existing trainers work unchanged.
router.add_api_route("/export_trajectories", export_trajectories, **_EXPORT)
