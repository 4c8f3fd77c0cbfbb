"""The real router with AREAL_TLS_* set: mutual TLS on its gRPC port and on its polls of the
proxies, in addition to the internal token."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_router.server import RouterServer, create_server
from areal_router.settings import RouterSettings
from areal_runtime import tls
from areal_runtime.auth import TOKEN_ENV, call_metadata

pytestmark = pytest.mark.timeout(30)

SETTINGS = RouterSettings(
    port=0,
    metrics_port=-1,
    health_interval=0.05,
    health_timeout=0.5,
    unhealthy_after=2,
    drain_timeout=0.5,
)
TOKEN = "test-internal-token-0123456789"


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A service CA and the shared certificate it issued (SAN DNS:areal-internal), made with
    the openssl command line (the router does not depend on `cryptography`)."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca, key, csr, cert, ext = (
        d / n for n in ("ca.key", "ca.pem", "key.pem", "csr", "cert.pem", "ext.cnf")
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
             "-subj", "/CN=areal test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign")  # fmt: skip
    _openssl("req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=areal-internal")
    ext.write_text(
        f"subjectAltName=DNS:{tls.SERVER_NAME}\nbasicConstraints=critical,CA:FALSE\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-days", "1", "-out", cert, "-extfile", ext)  # fmt: skip
    os.chmod(key, 0o600)
    return {tls.CA_ENV: str(ca), tls.CERT_ENV: str(cert), tls.KEY_ENV: str(key)}


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch, pki: dict[str, str]) -> Iterator[dict[str, str]]:
    for var, path in pki.items():
        monkeypatch.setenv(var, path)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    tls.config.cache_clear()
    yield pki
    tls.config.cache_clear()


@pytest.fixture
async def router(tls_env) -> AsyncIterator[RouterServer]:
    server = create_server(SETTINGS)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown(grace=0)


class TlsProxy(proxy_pb2_grpc.ProxyStatusServiceServicer):
    """A proxy's status service, bound the way the real proxies bind (tls.bind)."""

    def __init__(self) -> None:
        self.polls = 0
        self.server = grpc.aio.server()
        proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server(self, self.server)
        self.port = tls.bind(self.server, "127.0.0.1:0")

    async def GetStats(self, request, context):
        self.polls += 1
        return proxy_pb2.ProxyStats(healthy=True, model="m")


async def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code()


async def test_plaintext_client_is_refused(router: RouterServer):
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        call = stub.ListModels(router_pb2.ListModelsRequest(), metadata=call_metadata(), timeout=5)
        assert await _code(call) == grpc.StatusCode.UNAVAILABLE


async def test_tls_client_needs_the_token_too(router: RouterServer):
    async with tls.channel(router.address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        call = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
        assert await _code(call) == grpc.StatusCode.UNAUTHENTICATED
        await stub.ListModels(router_pb2.ListModelsRequest(), metadata=call_metadata(), timeout=5)


async def test_router_polls_proxies_over_tls(router: RouterServer):
    proxy = TlsProxy()
    await proxy.server.start()
    try:
        async with tls.channel(router.address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            info = router_pb2.ProxyInfo(
                proxy_id="m-0", address=f"127.0.0.1:{proxy.port}", model="m"
            )
            await stub.RegisterProxy(
                router_pb2.RegisterProxyRequest(proxy=info), metadata=call_metadata(), timeout=5
            )
            deadline = asyncio.get_running_loop().time() + 5
            while router.registry.proxies["m-0"].health != router_pb2.PROXY_HEALTH_HEALTHY:
                assert asyncio.get_running_loop().time() < deadline, "never polled over TLS"
                await asyncio.sleep(0.02)
            assert proxy.polls >= 1
            r = await stub.Route(
                router_pb2.RouteRequest(model="m"), metadata=call_metadata(), timeout=5
            )
            assert r.proxy_id == "m-0"
    finally:
        await proxy.server.stop(0)
