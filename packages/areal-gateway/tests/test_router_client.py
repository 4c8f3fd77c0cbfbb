"""RouterClient against a real gRPC router (the fake one) that goes away and comes back."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import free_port
from fakes import TOKEN, FakeRouter

from areal_gateway.clients import RouterClient
from areal_gateway.clients import router as router_client
from areal_gateway.clients.router import RouterUnreachable
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime.auth import InternalTokenInterceptor
from areal_runtime.errors import ServiceError


async def serve(fake: FakeRouter, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(TOKEN)])
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


def fake_router() -> FakeRouter:
    fake = FakeRouter()
    fake.models["m"] = router_pb2.ModelInfo(name="m", kind=router_pb2.MODEL_KIND_INTERNAL)
    fake.proxies["p"] = router_pb2.ProxyInfo(
        proxy_id="p", address="127.0.0.1:1", model="m", health=router_pb2.PROXY_HEALTH_HEALTHY
    )
    return fake


async def test_a_restarted_router_is_a_delay_for_patient_calls_and_fast_for_others() -> None:
    """The router is killed; one like it comes back on the same port 0.8 s later (as the
    watchdog restarts it). A patient call made while it is away answers once it is back;
    one that is not patient fails at once with RouterUnreachable, whose message names no
    internal address."""
    fake = fake_router()
    port = free_port()
    server = await serve(fake, port)
    client = RouterClient(f"127.0.0.1:{port}", TOKEN)
    try:
        assert (await client.route("m")).proxy_id == "p"
        await server.stop(None)  # gone, connections closed
        t0 = time.monotonic()
        with pytest.raises(RouterUnreachable) as exc:
            await client.route("m", patient=False)
        assert time.monotonic() - t0 < 0.5
        assert exc.value.http_status == 503 and exc.value.code == "upstream_unavailable"
        assert "127.0.0.1" not in exc.value.message and str(port) not in exc.value.message

        async def come_back() -> grpc.aio.Server:
            await asyncio.sleep(0.8)
            return await serve(fake, port)

        back = asyncio.ensure_future(come_back())
        t0 = time.monotonic()
        resp = await client.route("m")  # patient by default
        took = time.monotonic() - t0
        server = await back
        assert resp.proxy_id == "p"
        # Back at 0.8 s; the channel retries at least every 200 ms.
        assert 0.7 < took < 1.4, took
        # The router's own refusal is never taken for an unreachable router.
        with pytest.raises(ServiceError) as refused:
            await client.route("nope", patient=True)
        assert not isinstance(refused.value, RouterUnreachable)
    finally:
        await client.close()
        await server.stop(None)


async def test_a_router_that_stays_away_fails_patient_calls_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(router_client, "ROUTER_RESTART_WAIT_S", 0.5)
    client = RouterClient(f"127.0.0.1:{free_port()}", TOKEN)
    try:
        t0 = time.monotonic()
        with pytest.raises(RouterUnreachable):
            await client.bind_sessions(["s"], "m")
        assert time.monotonic() - t0 < 1.5
    finally:
        await client.close()
