"""What every agent-mode endpoint shares: who calls, where a session lives, session creation.

Keys: the admin key, or a session key minted here (`areal_runtime.session_keys`). The
gateway checks the key's MAC (a forged key is a 401 before anything is routed or pinned) and
reads the session it was minted for; the data proxy holding the session checks the key's
hash on every call (turns, close, history, reward, export). The gateway keeps no key, and a
restarted gateway given the same secret still accepts them. A key for another session is
refused here (403) before anything is routed.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.requests import Request

# Shared with the inference-mode endpoints; re-exported for the agent modules.
from areal_gateway.api import gateway as gateway
from areal_gateway.api import json_response as json_response
from areal_gateway.auth import Principal
from areal_gateway.auth import require_admin as require_admin
from areal_gateway.clients import AgentProxyClient
from areal_gateway.openai.errors import bad_request
from areal_gateway.runtime import Gateway
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import NoHealthyReplica, PermissionDenied, ServiceError
from areal_runtime.session_keys import new_id

log = logging.getLogger("areal_gateway.agent")

# The router model every agent pair is registered under.
AGENT_MODEL = "agent"
AGENT_KIND = router_pb2.PROXY_KIND_AGENT
SESSION_HEADER = "x-areal-session-id"
# A session-metadata key the agent proxy takes out of the metadata on creation: that
# session's idle timeout in seconds (at most the proxy's --session-timeout). The same string
# as areal_proxy.agent.sessions.IDLE_TIMEOUT_KEY; reserved (POST /v1/sessions refuses it).
IDLE_TIMEOUT_KEY = "areal_idle_timeout_s"
# The idle timeout of a session the gateway makes for one admin turn without a session
# (kept so that `previous_response_id` can chain on it; `store: false` ends it at once).
IMPLICIT_SESSION_TTL_S = 300.0


def principal(gw: Gateway, request: Request) -> Principal:
    """The admin, or the holder of a session key this gateway minted (its MAC checked here,
    its hash by the proxy); anything else 401. The one key check of both modes."""
    return gw.auth.principal(request)


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


async def create_session(
    gw: Gateway, metadata: dict[str, Any], idle_timeout: float | None = None
) -> dict[str, Any]:
    """Mint an id and key, pin the session to the least-loaded pair, create it there
    (`idle_timeout`: this session's, shorter than the proxy's --session-timeout)."""
    if idle_timeout is not None:
        metadata = {**metadata, IDLE_TIMEOUT_KEY: idle_timeout}
    session_id = new_id("agent")
    key = gw.auth.mint_session_key(session_id)
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


def store_flag(doc: dict[str, Any]) -> bool:
    """The Responses API's `store` (default true, as OpenAI's)."""
    store = doc.get("store")
    if store is None:
        return True
    if not isinstance(store, bool):
        raise bad_request("'store' must be a boolean.", code="invalid_type", param="store")
    return store


def normalize_content(content: Any) -> Any:
    """A message's content as the agent gets it: text parts joined to one string; other
    content (images, ...) passes as the list of parts."""
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content
