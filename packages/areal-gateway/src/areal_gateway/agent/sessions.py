"""Session endpoints of the agent gateway.

| POST   /v1/sessions                 | admin        | 201 {session_id, session_api_key, rl_session_id?} |
| DELETE /v1/sessions/{id}            | admin or own | {session_id, closed}                             |
| GET    /v1/sessions/{id}/history    | admin or own | {session_id, history: [...]}                     |
| POST   /v1/sessions/{id}/reward     | admin or own | {session_id, interaction_id, reward} (linked)    |
| POST   /v1/sessions/{id}/export     | admin or own | {count, rows: [...], export_id?} (linked)        |
| POST   /v1/sessions/{id}/ack_export | admin or own | {export_id, removed, kept} (linked)              |
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends
from starlette.responses import Response

from areal_gateway.agent.common import (
    IDLE_TIMEOUT_KEY,
    check_session_access,
    create_session,
    log,
    proxy_of,
    release,
    session_key_of,
)
from areal_gateway.api import ERRORS, AdminKey, AnyKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.openai.errors import bad_request
from areal_gateway.schemas import (
    AckExportRequest,
    AckExportResult,
    AgentExportRequest,
    AgentExportResult,
    AgentRewardRequest,
    ClosedSession,
    CreatedSession,
    CreateSessionRequest,
    RewardResult,
    SessionHistory,
)
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


def _own_session(session_id: str, p: AnyKey) -> str:
    # A dependency, so that another session's key is a 403 before its body is validated.
    check_session_access(p, session_id)
    return session_id


# The `{session_id}` of the path, which the caller may act on.
SessionId = Annotated[str, Depends(_own_session)]

router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["agent sessions"])


@router.post("/v1/sessions", status_code=201, response_model=CreatedSession)
async def create(
    gw: GatewayDep,
    _: AdminKey,
    body: Annotated[CreateSessionRequest, Body(default_factory=CreateSessionRequest)],
) -> Response:
    """A session on the least-loaded pair, with its own key."""
    metadata = dict(body.metadata or {})
    if IDLE_TIMEOUT_KEY in metadata:
        raise bad_request(
            f"'metadata.{IDLE_TIMEOUT_KEY}' is reserved.",
            code="invalid_value",
            param=f"metadata.{IDLE_TIMEOUT_KEY}",
        )
    out = await create_session(gw, metadata)
    return json_response(out, 201)


@router.delete("/v1/sessions/{session_id}", response_model=ClosedSession)
async def close(sid: SessionId, gw: GatewayDep, p: AnyKey) -> Response:
    """Close a session (the admin key, or its own)."""
    client = await proxy_of(gw, sid)
    existed = await client.close_session(sid, session_key_of(p))
    await release(gw, sid)
    if not existed:
        raise_not_found(sid)
    log.info("session %s closed", sid)
    return json_response({"session_id": sid, "closed": True})


def raise_not_found(sid: str) -> None:
    raise SessionNotFound(f"session '{sid}' not found")


@router.get("/v1/sessions/{session_id}/history", response_model=SessionHistory)
async def history(sid: SessionId, gw: GatewayDep, p: AnyKey) -> Response:
    """The session's messages so far."""
    client = await proxy_of(gw, sid)
    raw = await client.history(sid, session_key_of(p))
    return Response(
        b'{"session_id":' + orjson.dumps(sid) + b',"history":' + (raw or b"[]") + b"}",
        media_type="application/json",
    )


@router.post("/v1/sessions/{session_id}/reward", response_model=RewardResult)
async def reward(sid: SessionId, body: AgentRewardRequest, gw: GatewayDep, p: AnyKey) -> Response:
    """Reward the session's last interaction, or `interaction_id` (a linked agent service)."""
    interaction_id = body.interaction_id or ""
    client = await proxy_of(gw, sid)
    resp = await client.set_reward(
        proxy_pb2.SetRewardRequest(
            session_id=sid,
            interaction_id=interaction_id,
            reward=body.reward,
            envelope=_envelope(p, sid, 60.0),
        )
    )
    return json_response(
        {"session_id": sid, "interaction_id": resp.interaction_id, "reward": resp.reward}
    )


@router.post("/v1/sessions/{session_id}/export", response_model=AgentExportResult)
async def export(
    sid: SessionId,
    gw: GatewayDep,
    p: AnyKey,
    body: Annotated[AgentExportRequest, Body(default_factory=AgentExportRequest)],
) -> Response:
    """The session's trajectory rows (a linked agent service), in the shape of
    `/rl/export_trajectories`: `{"count", "rows"}`. With `remove_session` nothing is removed
    yet: the answer names an `export_id`, and `POST /v1/sessions/{id}/ack_export` with it,
    once the client has every row, removes the session's RL records (until then another
    export returns the same rows)."""
    style, discount, remove = body.style or "concat", body.discount, body.remove_session
    client = await proxy_of(gw, sid)
    timeout = gw.settings.request_timeout
    chunks = await client.export(
        proxy_pb2.ExportTrajectoriesRequest(
            session_ids=[sid],
            style=style,
            side_calls=body.side_calls or "include",
            discount=float(discount),
            remove_session=remove,
            envelope=_envelope(p, sid, timeout),
        ),
        timeout,
    )
    rows = [line for chunk in chunks for line in chunk.jsonl.splitlines() if line.strip()]
    # One session, one chunk: its export_id is the inference export's.
    export_id = next((c.export_id for c in chunks if c.export_id), "") if remove else ""
    tail = b',"export_id":' + orjson.dumps(export_id) if export_id else b""
    return Response(
        b'{"count":'
        + str(len(rows)).encode()
        + b',"rows":['
        + b",".join(rows)
        + b"]"
        + tail
        + b"}",
        media_type="application/json",
    )


@router.post("/v1/sessions/{session_id}/ack_export", response_model=AckExportResult)
async def ack_export(sid: SessionId, body: AckExportRequest, gw: GatewayDep, p: AnyKey) -> Response:
    """The client has every row of an export with `remove_session`: remove the session's RL
    records (a linked agent service), as `/rl/ack_export` does. `removed` / `kept` name the
    agent session: kept when it gained a turn or a reward after the export read it (export it
    again). Idempotent: again, it removes nothing more."""
    client = await proxy_of(gw, sid)
    out = await client.ack_export(
        proxy_pb2.AckAgentExportRequest(
            session_id=sid, export_id=body.export_id, envelope=_envelope(p, sid, 60.0)
        )
    )
    return json_response(
        {
            "export_id": body.export_id,
            "removed": list(out.removed_session_ids),
            "kept": list(out.kept_session_ids),
        }
    )
