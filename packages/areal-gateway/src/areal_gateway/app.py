"""`create_app(settings)`: the gateway's ASGI app (FastAPI, plain routes, no body models)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal_gateway import admin, control, rl
from areal_gateway.metrics import MetricsMiddleware
from areal_gateway.openai import chat, completions, models
from areal_gateway.openai.errors import error_response, install_error_handlers
from areal_gateway.runtime import Gateway
from areal_gateway.settings import Settings
from areal_runtime.errors import ServiceError


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    status = "draining" if gw.draining else "ok"
    body = {
        "status": status,
        "pid": gw.pid,
        "instance": gw.instance,
        "version": gw.version,
        "mode": gw.settings.mode,
    }
    return Response(
        orjson.dumps(body), status_code=503 if gw.draining else 200, media_type="application/json"
    )


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    data, ctype = gw.metrics.render()
    return Response(data, media_type=ctype)


async def not_implemented(request: Request) -> Response:
    return error_response(
        ServiceError(
            501,
            f"{request.method} {request.url.path}: agent-mode endpoints are not implemented yet "
            "(this gateway runs with --mode agent).",
            type="not_implemented_error",
            code="not_implemented",
        )
    )


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
    app = FastAPI(
        title="areal-gateway",
        version=gateway.version,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
        **extra,
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    # Plain Starlette routes (endpoints take the Request and read the body themselves).
    routes = app.router.routes
    routes.append(Route("/health", health, methods=["GET"]))
    routes.append(Route("/metrics", metrics, methods=["GET"]))
    if settings.mode == "inference":
        routes.extend(
            chat.routes
            + completions.routes
            + models.routes
            + admin.routes
            + rl.routes
            + control.routes
        )
    else:
        from areal_gateway import agent

        routes.extend(agent.routes)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    return app
