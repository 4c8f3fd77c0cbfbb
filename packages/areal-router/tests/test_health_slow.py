"""A proxy that answers its polls late is busy, not gone: it stays routable for
SLOW_GRACE_S after its last answer (one slow poll made a flooded proxy unroutable, and a burst
got 503 `no_healthy_proxy` while its engine worked); one silent for longer, or one that
refuses the connection, is unhealthy as before."""

from __future__ import annotations

import asyncio

import pytest
from test_health_push import HEALTHY, SETTINGS, UNHEALTHY, Proxy, Router, eventually, router

from areal_router import health

__all__ = ["router"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(60)


class SlowProxy(Proxy):
    """Answers GetStats after `delay` seconds (0: at once)."""

    delay: float = 0.0

    async def GetStats(self, request, context):
        if self.delay:
            await asyncio.sleep(self.delay)
        return await super().GetStats(request, context)


async def _add_slow(router: Router, proxy_id: str) -> SlowProxy:
    from areal_proto.router.v1 import router_pb2
    from areal_runtime.auth import call_metadata

    proxy = await SlowProxy("m").start()
    router.proxies.append(proxy)
    info = router_pb2.ProxyInfo(proxy_id=proxy_id, address=proxy.address, model="m")
    await router.stub.RegisterProxy(
        router_pb2.RegisterProxyRequest(proxy=info), metadata=call_metadata()
    )
    return proxy


async def test_late_polls_within_the_grace_keep_a_proxy_routable(router: Router, monkeypatch):
    monkeypatch.setattr(health, "SLOW_GRACE_S", 4.0)
    p = await _add_slow(router, "m-0")
    await eventually(lambda: router.state("m-0").health == HEALTHY, timeout=3)
    # Traffic keeps it on the fast cadence; every poll now times out (0.5 s deadline).
    p.delay = 0.8
    healths = []
    for _ in range(25):  # 2.5 s: two or three timed-out polls, over unhealthy_after (2)
        await router.route()
        healths.append(router.state("m-0").health)
        await asyncio.sleep(0.1)
    assert router.state("m-0").failures >= SETTINGS.unhealthy_after, "no poll timed out"
    assert set(healths) == {HEALTHY}, healths
    # It answers in time again: nothing changed for the clients.
    p.delay = 0.0
    await eventually(lambda: router.state("m-0").failures == 0, timeout=3)


async def test_a_proxy_silent_past_the_grace_is_unhealthy(router: Router, monkeypatch):
    monkeypatch.setattr(health, "SLOW_GRACE_S", 1.5)
    p = await _add_slow(router, "m-0")
    await eventually(lambda: router.state("m-0").health == HEALTHY, timeout=3)
    p.delay = 30.0
    await router.route()
    await eventually(lambda: router.state("m-0").health == UNHEALTHY, timeout=6)
