"""Prometheus metrics of one agent proxy, served on --metrics-port (/metrics): turns by
outcome, turn latency, errors, running turns, sessions, worker health. The series keep the
`areal_proxy_agent_` names they had when this proxy was a mode of areal-proxy, so dashboards
and alerts need no change."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)

# Outcomes of an agent turn: `ok`; `error` (the agent's error event, a worker failure, or a
# turn refused before it ran: unknown session, wrong key, draining); `cancelled` (the
# caller went away mid-turn).
TURN_OUTCOMES = ("ok", "error", "cancelled")


class AgentProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        r = self.registry
        self.turns = Counter(
            "areal_proxy_agent_turns_total", "agent turns by outcome", ["outcome"], registry=r
        )
        self.turn_seconds = Histogram(
            "areal_proxy_agent_turn_seconds",
            "agent turn latency, from the turn's RPC to its last event, by outcome",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "areal_proxy_agent_errors_total",
            "failed agent turns by error code (agent_error: the agent's own error event)",
            ["code"],
            registry=r,
        )
        self.running = Gauge(
            "areal_proxy_agent_running_turns", "agent turns running now", registry=r
        )
        self.sessions = Gauge("areal_proxy_agent_sessions", "open agent sessions", registry=r)
        self.worker_healthy = Gauge(
            "areal_proxy_agent_worker_healthy", "1 when the agent worker serves", registry=r
        )
        for outcome in TURN_OUTCOMES:  # every series exists from the start (reads 0)
            self.turns.labels(outcome)
            self.turn_seconds.labels(outcome)

    def start(self, host: str, port: int) -> int:
        """Serve /metrics on its own thread; returns the bound port (-1 = off)."""
        if port < 0:
            return -1
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe_turn(self, outcome: str, seconds: float, code: str = "") -> None:
        self.turns.labels(outcome).inc()
        self.turn_seconds.labels(outcome).observe(seconds)
        if outcome == "error":
            self.errors.labels(code or "unknown").inc()
