"""Prometheus metrics of the gateway (`GET /metrics`), one registry per app.

`MetricsMiddleware` is a plain ASGI wrapper (no BaseHTTPMiddleware): it counts requests by
endpoint, status and model and times them, for every route including errors and streams.

Two outcomes are the gateway's own words, not a status it sent:
* `status="499"` (`CLIENT_CLOSED`, as nginx counts it): the client went away before any
  response began; the gateway answered nothing, and nothing failed on its side;
* `model="unknown"`: a model name the catalog does not know (the label's values are only
  the registered models, "unknown" and "none" for a request that names no model, so a
  client cannot grow the series by inventing names).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLIENT_CLOSED = 499
NO_MODEL = "none"
UNKNOWN_MODEL = "unknown"
# Where a request's handler leaves what the counters need in its ASGI scope's state.
_MODEL = "areal_model"
_GONE = "areal_client_gone"

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

# Path -> endpoint label (aliases share one label; everything unknown is "other").
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/models": "models",
    "/rl/start_session": "rl_start_session",
    "/rl/set_reward": "rl_set_reward",
    "/rl/end_session": "rl_end_session",
    "/rl/export_trajectories": "rl_export",
    "/export_trajectories": "rl_export",
    "/rl/ack_export": "rl_ack_export",
    "/openapi.json": "openapi",
    "/health": "health",
    "/metrics": "metrics",
}
# Paths with an id in them: one label per kind, never per id (bounded label values).
PREFIXES = (
    ("/rl/sessions/", "rl_session"),
    ("/v1/sessions", "agent_sessions"),
    ("/v1/messages/", "messages"),
    ("/v1/responses/", "responses"),
    ("/responses/", "responses"),
    ("/docs", "docs"),
    ("/admin/", "admin"),
)


def note_model(scope: Scope, label: str) -> None:
    """The model label of this request (see `model_label`), for its request counter."""
    scope.setdefault("state", {})[_MODEL] = label


def note_client_gone(scope: Scope) -> None:
    """The client went away: a request that had no response yet counts as 499."""
    scope.setdefault("state", {})[_GONE] = True


def outcome(scope: Scope, status: int, started: bool) -> tuple[str, str]:
    """(status, model) label values of a finished request."""
    state = scope.get("state") or {}
    if not started and state.get(_GONE):
        status = CLIENT_CLOSED
    return str(status), state.get(_MODEL, NO_MODEL)


def endpoint_label(path: str) -> str:
    label = ENDPOINTS.get(path)
    if label is not None:
        return label
    for prefix, name in PREFIXES:
        if path.startswith(prefix):
            return name
    return "other"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "areal_gateway_requests_total",
            "HTTP requests by endpoint, status (499: the client went away before any "
            "response) and model (a registered one, unknown, or none)",
            ["endpoint", "status", "model"],
            registry=r,
        )
        self.latency = Histogram(
            "areal_gateway_request_seconds",
            "HTTP request duration (streams: until the last byte)",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "areal_gateway_inflight_requests", "HTTP requests in progress", ["endpoint"], registry=r
        )
        self.first_chunk = Histogram(
            "areal_gateway_stream_first_chunk_seconds",
            "Time from request to the first streamed chunk",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.stream_chunks = Counter(
            "areal_gateway_stream_chunks_total", "SSE chunks written", ["endpoint"], registry=r
        )
        self.routed = Counter(
            "areal_gateway_routed_total",
            "Routing decisions by model and proxy",
            ["model", "proxy_id"],
            registry=r,
        )
        self.errors = Counter(
            "areal_gateway_errors_total",
            "Errors returned, by HTTP status and code",
            ["status", "code"],
            registry=r,
        )
        self.retries = Counter(
            "areal_gateway_route_retries_total",
            "New routes after a proxy refused the connection",
            registry=r,
        )
        self.disconnects = Counter(
            "areal_gateway_client_disconnects_total",
            "Generations cancelled because the client went away",
            ["endpoint"],
            registry=r,
        )
        self.left_out = Counter(
            "areal_gateway_left_out_total",
            "Request parts areal cannot honour, left out of the prompt instead of refused "
            "(left_out.py), by API and kind",
            ["api", "what"],
            registry=r,
        )
        self.external = Counter(
            "areal_gateway_external_requests_total",
            "Requests forwarded to external models, by upstream status",
            ["status"],
            registry=r,
        )

        # Label children of the per-request series, looked up once.
        self._routed: dict[tuple[str, str], Any] = {}
        self._chunks: dict[str, Any] = {}

    def routed_to(self, model: str, proxy_id: str) -> Any:
        child = self._routed.get((model, proxy_id))
        if child is None:
            child = self._routed[(model, proxy_id)] = self.routed.labels(model, proxy_id)
        return child

    def chunks_of(self, endpoint: str) -> Any:
        child = self._chunks.get(endpoint)
        if child is None:
            child = self._chunks[endpoint] = self.stream_chunks.labels(endpoint)
        return child

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._inflight: dict[str, Any] = {}
        self._latency: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = endpoint_label(scope["path"])
        inflight = self._inflight.get(label)
        if inflight is None:
            inflight = self._inflight[label] = self.metrics.inflight.labels(label)
            self._latency[label] = self.metrics.latency.labels(label)
        status = 500
        started = False
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        inflight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            inflight.dec()
            self._latency[label].observe(time.perf_counter() - start)
            self.metrics.requests.labels(label, *outcome(scope, status, started)).inc()
