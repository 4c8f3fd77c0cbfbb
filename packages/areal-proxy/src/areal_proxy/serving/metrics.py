"""Prometheus metrics of one proxy, served on --metrics-port (/metrics): RPCs, tokens, engine.

The agent proxy's turn metrics live in areal_agent_proxy.metrics."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from areal_proxy.generation.migration import OUTCOMES as MIGRATION_OUTCOMES
from areal_proxy.prompt.incremental import FALLBACK_REASONS, Built
from areal_proxy.prompt.state import TurnCache

if TYPE_CHECKING:
    from areal_proxy.generation.controller import GenerationRecord

EXPORT_OUTCOMES = ("exported", "marked_stale", "dropped_stale", "dropped_group", "dropped_failed")
# Weight versions: the bounds asked in practice are small (0 to a few).
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 64)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class _Served:
    """A registry served over HTTP on its own thread."""

    registry: CollectorRegistry
    _server: Any = None
    _thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Serve /metrics; returns the bound port (-1 = off)."""
        if port < 0:
            return -1
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ProxyMetrics(_Served):
    def __init__(self, model: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "areal_proxy_requests_total",
            "RPCs by method and outcome",
            ["rpc", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "areal_proxy_request_seconds",
            "RPC latency",
            ["rpc"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "areal_proxy_time_to_first_token_seconds",
            "time from request to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "areal_proxy_inflight_requests", "generation RPCs in flight", registry=r
        )
        # By model (one per proxy: what a dashboard summing proxies groups by).
        self.prompt_tokens = Counter(
            "areal_proxy_prompt_tokens_total", "prompt tokens", ["model"], registry=r
        ).labels(model)
        self.completion_tokens = Counter(
            "areal_proxy_completion_tokens_total", "generated tokens", ["model"], registry=r
        ).labels(model)
        self.engine_errors = Counter(
            "areal_proxy_engine_errors_total", "engine failures by kind", ["kind"], registry=r
        )
        # Every outcome's series exists from the start (reads 0).
        self.migrations = Counter(
            "areal_proxy_migrations_total",
            "decisions on requests whose engine was lost: continued (moved to a peer), "
            "refused_constraint, refused_n, refused_limit, no_peer; peer_failed counts a peer "
            "lost under a continuation",
            ["outcome"],
            registry=r,
        )
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        self.resubmits = Counter(
            "areal_proxy_resubmits_total", "engine attempts resubmitted after a pause", registry=r
        )
        self.version = Gauge("areal_proxy_weight_version", "current weight version", registry=r)
        self.paused = Gauge("areal_proxy_paused", "1 while generation is paused", registry=r)
        self.engine_healthy = Gauge(
            "areal_proxy_engine_healthy", "1 when the engine is healthy", registry=r
        )
        self.engine_busy = Gauge(
            "areal_proxy_engine_busy",
            "1 while the engine's health check does not answer in time but the engine makes "
            "progress (healthy: busy, not lost)",
            registry=r,
        )
        self.engine_silent = Gauge(
            "areal_proxy_engine_silent_seconds",
            "seconds since the engine's last sign of life (a token, an answer, a health check "
            "answered in time)",
            registry=r,
        )
        # Flow control on `Generate` streams (multiplex.py). The gauge is read when scraped
        # (the servicer sets its function), so the data path never touches it.
        self.stream_held_results = Gauge(
            "areal_proxy_stream_held_results",
            "results queued on Generate streams for requests whose caller gave no credit",
            registry=r,
        )
        self.stream_credit_waits = Counter(
            "areal_proxy_stream_credit_waits_total",
            "times a streamed request's task waited because QUEUE_LIMIT of its results were "
            "queued unsent (no credit from the caller, or the stream's writer behind)",
            registry=r,
        )

        # How session chat prompts are built (prompt/incremental.py): every reason's series
        # exists from the start (reads 0).
        self.prompt_builds = Counter(
            "areal_proxy_prompt_builds_total",
            "session chat prompts by how they were built: incremental (continued the previous "
            "turn's) or full (the first turn, or a fallback)",
            ["path"],
            registry=r,
        )
        self.prompt_fallbacks = Counter(
            "areal_proxy_prompt_fallbacks_total",
            "session chat prompts built whole although the session had earlier turns, by reason",
            ["reason"],
            registry=r,
        )
        self.prompt_tokenized = Counter(
            "areal_proxy_prompt_tokenized_tokens_total",
            "prompt ids of session chat turns that were tokenized (the rest were continued)",
            registry=r,
        )
        for path in ("incremental", "full"):
            self.prompt_builds.labels(path)
        for reason in FALLBACK_REASONS:
            self.prompt_fallbacks.labels(reason)
        self.export_staleness = Histogram(
            "areal_proxy_export_row_staleness",
            "staleness of exported rows (current weight version minus the row's oldest "
            "trainable token's version)",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.export_rows = Counter(
            "areal_proxy_export_rows_total",
            "rows of exports by outcome: exported (marked_stale among them), dropped_stale, "
            "dropped_group (its group's policy dropped the group), dropped_failed (a failed "
            "member's rows left out of a group kept)",
            ["outcome"],
            registry=r,
        )
        for outcome in EXPORT_OUTCOMES:
            self.export_rows.labels(outcome)
        self.export_groups_dropped = Counter(
            "areal_proxy_export_groups_dropped_total",
            "groups an export's group policy dropped whole",
            registry=r,
        )
        self.export_masked_tokens = Counter(
            "areal_proxy_export_masked_tokens_total",
            "trainable tokens an export masked (loss_mask 0) as older than its bound",
            registry=r,
        )
        self.turn_cache_bytes = Gauge(
            "areal_proxy_prompt_cache_bytes",
            "estimated memory of the cached last turns of live sessions",
            registry=r,
        )
        self.turn_cache_sessions = Gauge(
            "areal_proxy_prompt_cache_sessions", "sessions with cached turns", registry=r
        )
        self.turn_cache_evictions = Gauge(
            "areal_proxy_prompt_cache_evictions",
            "sessions evicted from the turn cache since the proxy started",
            registry=r,
        )

    def observe_export(
        self,
        staleness: dict[int, int],
        rows: dict[str, int],
        groups_dropped: int,
        masked_tokens: int,
    ) -> None:
        """What one export handed over and what it held back (recording/selection.py):
        exported rows by staleness, rows by outcome (EXPORT_OUTCOMES)."""
        for value, n in staleness.items():
            for _ in range(n):
                self.export_staleness.observe(value)
        for outcome, n in rows.items():
            self.export_rows.labels(outcome).inc(n)
        self.export_groups_dropped.inc(groups_dropped)
        self.export_masked_tokens.inc(masked_tokens)

    def observe_prompt(self, built: Built) -> None:
        self.prompt_builds.labels("incremental" if built.incremental else "full").inc()
        if built.reason:
            self.prompt_fallbacks.labels(built.reason).inc()
        self.prompt_tokenized.inc(built.tokenized)

    def watch_turn_cache(self, cache: TurnCache) -> None:
        """The cache's gauges, read when scraped (nothing on the data path)."""
        self.turn_cache_bytes.set_function(lambda: cache.nbytes)
        self.turn_cache_sessions.set_function(lambda: len(cache))
        self.turn_cache_evictions.set_function(lambda: cache.evictions)

    def observe_finished(self, rec: GenerationRecord) -> None:
        """One finished generation (the controller's `on_finish`)."""
        ttft = rec.first_token_at - rec.created if rec.first_token_at is not None else None
        self.observe_generation(len(rec.prompt_ids), len(rec.token_ids), ttft, rec.attempts)

    def observe_generation(
        self, prompt: int, completion: int, ttft: float | None, attempts: int
    ) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
        if ttft is not None:
            self.ttft.observe(ttft)
        if attempts > 1:
            self.resubmits.inc(attempts - 1)
