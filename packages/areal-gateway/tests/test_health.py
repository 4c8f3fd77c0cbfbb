"""`GET /health` tells the truth about the service and stays 200 while the gateway
itself works (the CLI's watchdog probes it for hangs: a 503 would restart a healthy gateway).

It used to say "ok" while a model's only proxy was dead and every chat answered 503.
"""

from __future__ import annotations

import time

import httpx
from conftest import Stack, free_port, wait_until

from areal_proto.router.v1 import router_pb2


def _health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_dead_replica_shows_as_degraded_with_counts(stack: Stack) -> None:
    stack.register("m-health")
    url = stack.url
    pid0, pid1 = "m-health-p0", "m-health-p1"
    assert wait_until(
        lambda: _health(url)["models"].get("m-health") == {"healthy": 2, "total": 2}, 5
    )
    try:
        stack.router.set_health(pid0, router_pb2.PROXY_HEALTH_UNHEALTHY)
        assert wait_until(
            lambda: _health(url)["models"]["m-health"] == {"healthy": 1, "total": 2}, 5
        )
        body = _health(url)
        assert body["status"] == "degraded" and body["router"] == "ok"
        assert body["pid"] and body["instance"] and body["mode"] == "inference"
        stack.router.set_health(pid1, router_pb2.PROXY_HEALTH_UNHEALTHY)
        assert wait_until(
            lambda: _health(url)["models"]["m-health"] == {"healthy": 0, "total": 2}, 5
        )
    finally:
        stack.router.set_health(pid0, router_pb2.PROXY_HEALTH_HEALTHY)
        stack.router.set_health(pid1, router_pb2.PROXY_HEALTH_HEALTHY)
    assert wait_until(lambda: _health(url)["models"]["m-health"] == {"healthy": 2, "total": 2}, 5)
    everything_healthy = all(
        p.health == router_pb2.PROXY_HEALTH_HEALTHY for p in stack.router.proxies.values()
    )
    if everything_healthy:  # other tests share the fake router
        assert _health(url)["status"] == "ok"


def test_the_router_listing_is_cached_not_asked_per_probe(stack: Stack) -> None:
    _health(stack.url)
    before = stack.router.list_models_calls
    t0 = time.monotonic()
    for _ in range(30):
        _health(stack.url)
    took = time.monotonic() - t0
    # At most one listing a second (the stack's one gateway probes alone here).
    assert stack.router.list_models_calls - before <= took + 2, took


def test_a_router_that_is_gone_is_degraded_and_health_stays_quick(stack: Stack) -> None:
    gw = stack.start_gateway(router_addr=f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    body = _health(gw.url)
    assert time.monotonic() - t0 < 2.0
    assert body["status"] == "degraded" and body["router"] != "ok"
