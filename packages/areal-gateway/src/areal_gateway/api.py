"""FastAPI plumbing for the JSON APIs (admin, RL, control, agent sessions and pairs).

FastAPI reads and validates a request's body before it runs any dependency, so on its own a
request without a key and with a bad body would get a 400, and an oversized body would be
read whole. `GatewayRoute` runs first, in this order: the key check (401), the admin check for
an endpoint that depends on `admin` (403), the size-capped body read (413) and the JSON parse
(400 `invalid_json` / `invalid_body`, the messages of the generation path). FastAPI then
validates the parsed object against the endpoint's model (a 400 in the OpenAI shape, made by
`openai.errors`), and the endpoint runs.

The generation endpoints are not here: `fastpath.py` serves them without FastAPI.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
from fastapi import Depends, Security
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from areal_gateway.auth import Principal, require_admin
from areal_gateway.openai.forward import parse_bounded, read_body
from areal_gateway.runtime import Gateway


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorBody(BaseModel):
    """Every error the gateway answers: `{"error": {"message", "type", "code", "param"}}`."""

    error: ErrorDetail


# For every operation in the document: what an error looks like. Declaring "4XX" also stops
# FastAPI from documenting its own 422 body, which this gateway never sends.
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {
        "model": ErrorBody,
        "description": "400 bad body (param names the field), 401 no or unknown key, "
        "403 a key that may not do this, 404, 409, 413 body too large",
    },
    "5XX": {"model": ErrorBody, "description": "the router, a proxy or an engine failed"},
}


class GatewayRequest(Request):
    """A request whose caller is known and whose body the gateway already read and parsed."""

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        principal: Principal,
        raw: bytes | None,
        doc: dict[str, Any] | None,
    ) -> None:
        super().__init__(scope, receive)
        self.principal = principal
        self._raw = raw
        self._doc = doc

    async def body(self) -> bytes:
        if self._raw is None:
            return await super().body()
        return self._raw

    async def json(self) -> Any:
        if self._doc is None:
            return await super().json()
        return self._doc


def _json_content_type(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    # The gateway reads every body as JSON whatever it is labelled (`curl -d` sends a form
    # type); FastAPI parses by the label, so the parsed request says what it holds.
    out = [(k, v) for k, v in headers if k != b"content-type"]
    out.append((b"content-type", b"application/json"))
    return out


def _depends_on(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return any(d.call is call or _depends_on(d, call) for d in dependant.dependencies)


class GatewayRoute(APIRoute):
    """An `APIRoute` that checks the key and reads the body before FastAPI does (see above)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        admin_only = _depends_on(self.dependant, admin)
        has_body = self.body_field is not None
        body_required = self.body_field is not None and self.body_field.field_info.is_required()

        async def checked_first(request: Request) -> Response:
            gw: Gateway = request.app.state.gateway
            principal = gw.auth.principal(request)
            if admin_only:
                require_admin(principal)
            scope = request.scope
            raw: bytes | None = None
            doc: dict[str, Any] | None = None
            if has_body:
                raw = await read_body(request, gw.settings.max_body_bytes)
                if body_required or raw.strip():
                    doc = parse_bounded(raw)
                    scope = {**scope, "headers": _json_content_type(scope["headers"])}
                else:
                    raw = b""  # no body: FastAPI uses the model's defaults
            return await handler(GatewayRequest(scope, request.receive, principal, raw, doc))

        return checked_first


# HTTPBearer only documents the scheme in OpenAPI (auto_error=False: it never answers itself);
# GatewayRoute has already checked the key when a dependency runs.
_bearer = HTTPBearer(
    auto_error=False,
    description="The admin key (`AREAL_ADMIN_API_KEY`) or a session key (`areal-sk-...`).",
)


def caller(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Principal:
    """Whoever holds a valid key: the admin, or a session."""
    if isinstance(request, GatewayRequest):
        return request.principal
    gw: Gateway = request.app.state.gateway
    return gw.auth.principal(request)


def admin(principal: Annotated[Principal, Depends(caller)]) -> Principal:
    """The admin key only (GatewayRoute checks it before reading the body)."""
    require_admin(principal)
    return principal


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


AnyKey = Annotated[Principal, Depends(caller)]
AdminKey = Annotated[Principal, Depends(admin)]
GatewayDep = Annotated[Gateway, Depends(gateway)]


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """The endpoints' answers, serialized as they always were (the response models describe
    them in the OpenAPI document; FastAPI passes a `Response` through unchanged)."""
    return Response(
        orjson.dumps(data), status_code=status, media_type="application/json", headers=headers
    )
