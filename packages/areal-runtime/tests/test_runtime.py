"""The shared service runtime: settings, ready file, errors over real gRPC, internal token."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field

import grpc
import pytest

from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime import auth, errors, ready, settings


@dataclass
class _Settings:
    host: str = "127.0.0.1"
    port: int = 0
    ratio: float = 1.5
    verbose: bool = False
    policy: str = field(
        default="round_robin", metadata={"choices": ["round_robin", "least_loaded"]}
    )
    admin_api_key: str = field(default="", metadata={"secret": True})


def _parse(argv, **kw):
    return settings.parse_settings(
        _Settings, argv, prog="t", env_prefix="AREAL_T_", version="1", **kw
    )


def test_defaults_flags_and_env_precedence(monkeypatch):
    assert _parse([]) == _Settings()
    monkeypatch.setenv("AREAL_T_PORT", "9000")
    monkeypatch.setenv("AREAL_T_VERBOSE", "yes")
    s = _parse(["--ratio", "2.5"])
    assert (s.port, s.verbose, s.ratio) == (9000, True, 2.5)
    assert _parse(["--port", "1", "--no-verbose"]).port == 1
    assert _parse(["--no-verbose"]).verbose is False


def test_secret_only_from_environment(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse(["--admin-api-key", "x"])
    monkeypatch.setenv("AREAL_T_ADMIN_API_KEY", "s3cret")
    assert _parse([]).admin_api_key == "s3cret"


def test_bad_values_are_usage_errors(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        _parse(["--policy", "random"])
    assert info.value.code == 2
    monkeypatch.setenv("AREAL_T_PORT", "eighty")
    with pytest.raises(ValueError, match="AREAL_T_PORT: expected int"):
        _parse([])


def test_ready_file_is_atomic_private_json(tmp_path):
    path = tmp_path / "sub" / "ready.json"
    ready.write_ready_file(path, host="127.0.0.1", port=1234, version="0.1.0", metrics_port=5)
    info = json.loads(path.read_text())
    assert info["pid"] == os.getpid() and info["port"] == 1234 and info["metrics_port"] == 5
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["ready.json"]


class _Router(router_pb2_grpc.RouterServiceServicer):
    async def Route(self, request, context):
        if request.model == "missing":
            await errors.abort(
                context,
                errors.ServiceError(
                    404, "model 'missing' not found", code="model_not_found", param="model"
                ),
            )
        if request.model == "raw":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy proxy")
        return router_pb2.RouteResponse(proxy_id="p0", address="127.0.0.1:1")


@pytest.fixture
async def router_addr(monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, "tok-123")
    server = grpc.aio.server(interceptors=auth.server_interceptors())
    router_pb2_grpc.add_RouterServiceServicer_to_server(_Router(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def test_error_detail_round_trips_over_grpc(router_addr):
    async with grpc.aio.insecure_channel(router_addr) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Route(
                router_pb2.RouteRequest(model="missing"), metadata=auth.call_metadata()
            )
        err = errors.from_rpc_error(info.value)
        assert (err.http_status, err.code, err.param) == (404, "model_not_found", "model")
        assert err.to_openai()["error"]["message"] == "model 'missing' not found"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Route(router_pb2.RouteRequest(model="raw"), metadata=auth.call_metadata())
        err = errors.from_rpc_error(info.value, target="router")
        assert err.http_status == 503 and "router unavailable" in err.message


async def test_internal_token_required(router_addr):
    async with grpc.aio.insecure_channel(router_addr) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        ok = await stub.Route(router_pb2.RouteRequest(model="m"), metadata=auth.call_metadata())
        assert ok.proxy_id == "p0"
        for md in [(), ((auth.TOKEN_METADATA_KEY, "wrong"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Route(router_pb2.RouteRequest(model="m"), metadata=md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_mapping_without_detail():
    e = errors.ServiceError(429, "slow down")
    assert e.grpc_status() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.type == "rate_limit_error"
    assert errors.ServiceError(500, "x").type == "api_error"
