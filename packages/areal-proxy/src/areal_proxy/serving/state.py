"""What the proxy knows of itself that the servicer answers with and the health loop writes:
its model and engine, the engine's health, draining and retirement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProxyState:
    model: str
    engine_url: str
    proxy_id: str = ""
    engine_healthy: bool = False
    engine_detail: str = "engine not checked yet"
    # Healthy, but its last health check did not answer in time while it made progress
    # (engine/progress.py): it is working, not lost.
    engine_busy: bool = False
    draining: bool = False
    # Retired (graceful drain, retirement.py): its engine takes no work; it reports
    # `draining` so the router sends it only the turns of sessions pinned to it.
    retired: bool = False
