"""`GET` and `DELETE /v1/responses/{response_id}` (aliases `/responses/{response_id}`).

The stored responses (store.py) of the caller: a session key sees its session's, the admin
key the admin's. Anything else, another key's included, is the same 404 as an unknown id,
so a caller never learns that someone else's response exists.
"""

from __future__ import annotations

import logging
import sqlite3

from fastapi import APIRouter
from starlette.responses import Response

from areal_gateway.api import ERRORS, AnyKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.openai.responses.endpoint import owner_of
from areal_gateway.openai.shapes import DeletedResponse, ResponseObject
from areal_runtime.errors import InternalError, NotFound

log = logging.getLogger(__name__)

router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["OpenAI: responses"])


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"No response found with id {response_id!r} (unknown, expired, deleted, made with "
        "'store': false, or by another key).",
        code="response_not_found",
        param="response_id",
    )


def _store_failed(exc: Exception) -> InternalError:
    log.error("the response store failed: %s", exc)
    return InternalError("The gateway's response store failed; try again.")


async def get_response(response_id: str, gw: GatewayDep, principal: AnyKey) -> Response:
    """A stored response, as its POST answered it (status completed or incomplete)."""
    try:
        body = await gw.responses.response(response_id, owner_of(principal))
    except (sqlite3.Error, OSError) as exc:
        raise _store_failed(exc) from None
    if body is None:
        raise _not_found(response_id)
    return Response(body, media_type="application/json")


async def delete_response(response_id: str, gw: GatewayDep, principal: AnyKey) -> Response:
    """Delete a stored response. Responses that continued it can still be read, but no
    longer continued (their conversation needs this one's turn)."""
    try:
        deleted = await gw.responses.delete(response_id, owner_of(principal))
    except (sqlite3.Error, OSError) as exc:
        raise _store_failed(exc) from None
    if not deleted:
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


for _prefix in ("/v1", ""):
    router.add_api_route(
        f"{_prefix}/responses/{{response_id}}",
        get_response,
        methods=["GET"],
        response_model=ResponseObject,
        include_in_schema=bool(_prefix),
        operation_id="getResponse" if _prefix else "getResponseAlias",
    )
    router.add_api_route(
        f"{_prefix}/responses/{{response_id}}",
        delete_response,
        methods=["DELETE"],
        response_model=DeletedResponse,
        include_in_schema=bool(_prefix),
        operation_id="deleteResponse" if _prefix else "deleteResponseAlias",
    )
