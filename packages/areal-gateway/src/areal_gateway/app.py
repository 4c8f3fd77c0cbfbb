"""`create_app(settings)`: the gateway's ASGI app.

The JSON APIs (admin, RL, control, stored responses; in agent mode sessions and pairs) are
FastAPI routes with pydantic models (`schemas.py`). Health, metrics, the model list and the
generation paths are plain routes or, for the OpenAI and Anthropic hot path, served by
`fastpath.py` in front of this app; `apidoc.py` describes them all in `GET /openapi.json`
and `GET /docs` (no key needed: the document holds no secret).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway import admin, admission, apidoc, control, rl
from areal_gateway.metrics import MetricsMiddleware
from areal_gateway.openai import models
from areal_gateway.openai.errors import install_error_handlers
from areal_gateway.openai.responses import routes as stored_responses
from areal_gateway.runtime import Gateway
from areal_gateway.settings import Settings


async def health(request: Request) -> Response:
    """200 while this gateway works (the watchdog's hang probe), 503 while it drains; the body
    says how the service behind it is: `"status": "degraded"` and per-model healthy/total
    replicas (health.py), so a dead replica shows here rather than only as chats' 503s."""
    gw: Gateway = request.app.state.gateway
    body: dict[str, object] = {
        "status": "draining" if gw.draining else "ok",
        "pid": gw.pid,
        "instance": gw.instance,
        "version": gw.version,
        "mode": gw.settings.mode,
    }
    if not gw.draining:
        service = await gw.health.report()
        body["status"] = service.pop("status")
        body.update(service)
    return Response(
        orjson.dumps(body), status_code=503 if gw.draining else 200, media_type="application/json"
    )


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    data, ctype = gw.metrics.render()
    return Response(data, media_type=ctype)


def api_routers(mode: str) -> list[APIRouter]:
    """The typed JSON APIs a gateway in `mode` serves (and documents)."""
    if mode == "inference":
        return [admin.router, admission.router, rl.router, control.router, stored_responses.router]
    from areal_gateway import agent

    return list(agent.routers)


def create_app(settings: Settings) -> FastAPI:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.aclose()

    extra: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        # FastAPI's native OpenTelemetry looks up the global providers (environment reads) on
        # every request; the gateway reports through its own Prometheus metrics instead.
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    summary = f"The {settings.mode} gateway's HTTP API (docs/services.md)."
    # FastAPI with Swagger UI served from the package (apidoc.py), at /docs and /docs/static.
    app = FastAPIOffline(
        title="areal-gateway",
        summary=summary,
        version=gateway.version,
        docs_url="/docs",
        redoc_url=None,
        static_url="/docs/static",
        openapi_url="/openapi.json",
        lifespan=lifespan,
        **extra,
    )
    apidoc.install(app, settings.mode, summary)
    app.state.gateway = gateway
    install_error_handlers(app)
    # Plain Starlette routes (endpoints take the Request and read the body themselves).
    routes = app.router.routes
    routes.append(Route("/health", health, methods=["GET"]))
    routes.append(Route("/metrics", metrics, methods=["GET"]))
    if settings.mode == "inference":
        # POST /v1/chat/completions and /v1/completions have no route here: the fast path in
        # front of this app (fastpath.py, installed by server.make_server) serves them.
        routes.extend(models.routes)
    else:
        from areal_gateway import agent

        routes.extend(agent.routes)
    for router in api_routers(settings.mode):
        app.include_router(router)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    return app
