"""What every agent-mode endpoint shares: who calls, where a session lives, session creation.

Keys: the admin key, or a session key minted here (`areal_runtime.session_keys`). The
gateway reads the session a key claims; the data proxy holding the session checks the key's
hash on every call (turns, close, history, reward, export), so the gateway keeps no key and a
restarted gateway still accepts them. A key for another session is refused here (403) before
anything is routed.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from areal_gateway.auth import Principal, bearer_key
from areal_gateway.clients import AgentProxyClient
from areal_gateway.openai.errors import bad_request
from areal_gateway.runtime import Gateway
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import NoHealthyReplica, PermissionDenied, ServiceError, Unauthenticated
from areal_runtime.session_keys import mint_key, new_id, session_of

log = logging.getLogger("areal_gateway.agent")

# The router model every agent pair is registered under.
AGENT_MODEL = "agent"
AGENT_KIND = router_pb2.PROXY_KIND_AGENT
SESSION_HEADER = "x-areal-session-id"


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(data), status_code=status, media_type="application/json", headers=headers
    )


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def principal(gw: Gateway, request: Request) -> Principal:
    """The admin, or the holder of a session key (checked by the proxy); anything else 401."""
    key = bearer_key(request.headers.get("authorization"))
    if not key:
        raise Unauthenticated(
            "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    if hmac.compare_digest(key.encode(), gw.settings.admin_api_key.encode()):
        return Principal(api_key=key, is_admin=True)
    session_id = session_of(key)
    if session_id is None:
        raise Unauthenticated("Invalid API key.", code="invalid_api_key")
    return Principal(api_key=key, is_admin=False, session_id=session_id)


def require_admin(p: Principal) -> None:
    if not p.is_admin:
        raise PermissionDenied("This endpoint needs the admin key.", code="admin_key_required")


def check_session_access(p: Principal, session_id: str) -> None:
    if not p.is_admin and p.session_id != session_id:
        raise PermissionDenied(
            "This session key may not act on that session.", code="forbidden_session"
        )


def session_key_of(p: Principal) -> str:
    """What the proxy must check on envelope-less calls ("" = the admin)."""
    return "" if p.is_admin else p.api_key


async def proxy_of(gw: Gateway, session_id: str) -> AgentProxyClient:
    """The pair a session is pinned to (503 fast when that pair is down)."""
    route = await gw.router.route(AGENT_MODEL, session_id=session_id, kind=AGENT_KIND)
    if not route.address:
        raise NoHealthyReplica("No healthy agent pair.", code="no_healthy_pair")
    return gw.agents.get(route.address)


async def create_session(gw: Gateway, metadata: dict[str, Any]) -> dict[str, Any]:
    """Mint an id and key, pin the session to the least-loaded pair, create it there."""
    session_id = new_id("agent")
    key = mint_key(session_id)
    bound = await gw.router.bind_sessions([session_id], AGENT_MODEL, kind=AGENT_KIND)
    client = gw.agents.get(bound.address)
    try:
        created = await client.create_session(session_id, key, orjson.dumps(metadata))
    except ServiceError:
        await release(gw, session_id)
        raise
    log.info("session %s created on %s", session_id, bound.proxy_id)
    out: dict[str, Any] = {"session_id": session_id, "session_api_key": key}
    if created.rl_session_id:
        out["rl_session_id"] = created.rl_session_id
    return out


async def release(gw: Gateway, session_id: str) -> None:
    try:
        await gw.router.release_sessions([session_id])
    except ServiceError as exc:
        log.warning("release of session %s at the router failed: %s", session_id, exc.message)


def metadata_of(doc: dict[str, Any]) -> dict[str, Any]:
    meta = doc.get("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise bad_request("'metadata' must be an object.", code="invalid_type", param="metadata")
    return dict(meta)


def stream_flag(doc: dict[str, Any]) -> bool:
    stream = doc.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", code="invalid_type", param="stream")
    return stream


def normalize_content(content: Any) -> Any:
    """A message's content as the agent gets it: text parts joined to one string; other
    content (images, ...) passes as the list of parts."""
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content
