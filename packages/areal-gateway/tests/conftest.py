"""The stack under test: FAKE router, two FAKE proxies, a FAKE OpenAI upstream and the real
gateway app served by uvicorn on 127.0.0.1:<port 0>, all in one background event loop."""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from areal_gateway.app import create_app
from areal_gateway.runtime import Gateway
from areal_gateway.server import bind_socket, make_server
from areal_gateway.settings import Settings
from areal_proto.router.v1 import router_pb2, router_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))

from fakes import (
    PROXY_SERVICES,
    TOKEN,
    BackgroundLoop,
    FakeProxy,
    FakeRouter,
    FakeUpstream,
    start_grpc,
    start_http,
)

ADMIN_KEY = "test-admin-key-0123456789"
MAX_BODY = 256 * 1024


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    server: Any
    task: Any


@dataclass
class Stack:
    bg: BackgroundLoop
    router: FakeRouter
    router_addr: str
    proxies: dict[str, FakeProxy]
    proxy_addrs: dict[str, str]
    upstream: FakeUpstream
    upstream_url: str
    gw: RunningGateway
    start_gateway: Callable[..., RunningGateway]

    @property
    def url(self) -> str:
        return self.gw.url

    def register(self, model: str, proxy_ids: list[str] | None = None) -> None:
        """Register an internal model straight on the fake router."""
        proxy_ids = proxy_ids if proxy_ids is not None else list(self.proxies)
        self.router.models[model] = router_pb2.ModelInfo(
            name=model, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=1700000000
        )
        for pid in proxy_ids:
            self.router.proxies[f"{model}-{pid}"] = router_pb2.ProxyInfo(
                proxy_id=f"{model}-{pid}",
                address=self.proxy_addrs[pid],
                model=model,
                kind=router_pb2.PROXY_KIND_INFERENCE,
                health=router_pb2.PROXY_HEALTH_HEALTHY,
            )

    def all_received(self) -> list[Any]:
        return [r for p in self.proxies.values() for r in p.received]

    def all_produced(self) -> list[tuple[str, int, float]]:
        return [t for p in self.proxies.values() for t in p.produced]

    def find(self, request_id: str) -> Any:
        for r in self.all_received():
            if r.envelope.request_id == request_id:
                return r
        raise AssertionError(f"no proxy received request {request_id}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    bg = BackgroundLoop()
    router = FakeRouter()
    proxies = {"p0": FakeProxy("p0"), "p1": FakeProxy("p1")}
    upstream = FakeUpstream()

    async def setup() -> Any:
        rserver, rport = await start_grpc(
            router, router_pb2_grpc.add_RouterServiceServicer_to_server
        )
        servers = [rserver]
        addrs = {}
        for name, fake in proxies.items():
            s, port = await start_grpc(fake, *PROXY_SERVICES)
            servers.append(s)
            addrs[name] = f"127.0.0.1:{port}"
        userver, uport, utask = await start_http(upstream.app)
        return servers, rport, addrs, (userver, utask), uport

    servers, rport, addrs, up, uport = bg.run(setup())
    router_addr = f"127.0.0.1:{rport}"
    started: list[RunningGateway] = []

    def start_gateway(**overrides: Any) -> RunningGateway:
        settings = Settings(
            router_addr=router_addr,
            admin_api_key=ADMIN_KEY,
            internal_token=TOKEN,
            max_body_bytes=MAX_BODY,
            request_timeout=30.0,
            drain_timeout=1.0,
            # The fake proxies answer the per-call RPCs only (see FakeProxy).
            proxy_streams=False,
        )
        settings = dataclasses.replace(settings, **overrides)

        async def go() -> RunningGateway:
            import asyncio

            sock = bind_socket("127.0.0.1", 0)
            app = create_app(settings)
            server = make_server(settings, app)
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
            return RunningGateway(
                f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.gateway, server, task
            )

        gw = bg.run(go())
        started.append(gw)
        return gw

    gw = start_gateway()
    yield Stack(
        bg=bg,
        router=router,
        router_addr=router_addr,
        proxies=proxies,
        proxy_addrs=addrs,
        upstream=upstream,
        upstream_url=f"http://127.0.0.1:{uport}/v1",
        gw=gw,
        start_gateway=start_gateway,
    )

    async def teardown() -> None:
        import asyncio

        for g in started:
            g.server.should_exit = True
        await asyncio.gather(*(g.task for g in started), return_exceptions=True)
        up[0].should_exit = True
        await up[1]
        for s in servers:
            await s.stop(None)

    bg.run(teardown())
    bg.close()


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        yield client
