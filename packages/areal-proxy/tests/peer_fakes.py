"""Proxies with peers for migration and drain tests: real ProxyServers on loopback and a
fake router answering ListProxies."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from proxy_fakes import FakeEngineClient, Harness, start

from areal_proto.router.v1 import router_pb2, router_pb2_grpc

HEALTHY = router_pb2.PROXY_HEALTH_HEALTHY


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.proxies: list[router_pb2.ProxyInfo] = []
        self.asked: list[tuple[str, int]] = []

    async def ListProxies(self, request: Any, context: Any) -> router_pb2.ListProxiesResponse:
        self.asked.append((request.model, request.kind))
        return router_pb2.ListProxiesResponse(proxies=self.proxies)


def _info(h: Harness, proxy_id: str, health: int = HEALTHY) -> router_pb2.ProxyInfo:
    return router_pb2.ProxyInfo(
        proxy_id=proxy_id,
        address=f"127.0.0.1:{h.server.port}",
        model="tiny-parrot",
        kind=router_pb2.PROXY_KIND_INFERENCE,
        health=health,
    )


@contextlib.asynccontextmanager
async def cluster(
    first: FakeEngineClient, peers: list[FakeEngineClient], *, router: bool = True, **over: Any
) -> AsyncIterator[tuple[Harness, list[Harness], FakeRouter]]:
    """P1 (proxy id p1, in front of `first`) and one proxy per peer engine (p2, p3, ...), all
    listed healthy by a fake router that P1 asks (unless `router` is False)."""
    fake = FakeRouter()
    rserver = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, rserver)
    rport = rserver.add_insecure_port("127.0.0.1:0")
    await rserver.start()
    hs: list[Harness] = []
    try:
        for i, engine in enumerate(peers):
            hs.append(await start(engine, proxy_id=f"p{i + 2}"))
        addr = f"127.0.0.1:{rport}" if router else ""
        p1 = await start(first, proxy_id="p1", router_addr=addr, **over)
        hs.insert(0, p1)
        fake.proxies = [_info(h, f"p{i + 1}") for i, h in enumerate(hs)]
        yield p1, hs[1:], fake
    finally:
        for h in hs:
            await h.close()
        await rserver.stop(None)


def count(h: Harness, outcome: str) -> float:
    value = h.server.metrics.registry.get_sample_value(
        "areal_proxy_migrations_total", {"outcome": outcome}
    )
    return value or 0.0


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
