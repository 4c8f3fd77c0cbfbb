"""A gateway whose internal token the router or a proxy refuses.

It used to start healthy and then answer every client 401, as if the client's key were wrong.
Now: it refuses to start (one line naming internal authentication, exit 1), a mismatch that
appears later (the router restarted with another token) is a 502 `internal_auth_failed` for
every caller whatever its key, and a proxy that refuses the token is refused at registration.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from conftest import ADMIN_KEY, Stack
from fakes import FakeProxy, start_grpc
from test_binary import command, env

from areal_gateway.clients import ProxyPool
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2_grpc
from areal_runtime.auth import call_metadata
from areal_runtime.errors import InternalAuthFailed

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_refused_token_fails_the_start_with_one_clear_line(stack: Stack, tmp_path: Path) -> None:
    import subprocess

    ready = tmp_path / "gw.json"
    r = subprocess.run(
        [*command(), "--router-addr", stack.router_addr, "--ready-file", str(ready)],
        env=env(AREAL_INTERNAL_TOKEN="not-the-routers-token-000000"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if "internal authentication" in line]
    assert len(lines) == 1, r.stderr
    assert stack.router_addr in lines[0] and "AREAL_INTERNAL_TOKEN" in lines[0]
    assert "Traceback" not in r.stderr
    assert not ready.exists(), "a gateway that cannot talk to its router never became ready"


def test_a_router_token_changed_at_run_time_is_a_502_never_a_client_401(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str]
) -> None:
    stack.register("m-auth")
    gw = stack.start_gateway()
    router = gw.gateway.router
    good = router._md
    try:
        # As if the router restarted with another token: it now refuses ours.
        router._md = call_metadata("the-router-has-another-token-0")
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            sid = "sess-" + "a" * 24
            keys = {"admin": ADMIN_KEY, "session": gw.gateway.auth.mint_session_key(sid)}
            for kind, key in keys.items():
                r = c.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "m-auth", "messages": MESSAGES},
                )
                assert r.status_code == 502, (kind, r.text)
                err = r.json()["error"]
                assert err["code"] == "internal_auth_failed", err
                assert "internal authentication" in err["message"]
            # The JSON APIs too (a router call behind them).
            r = c.get("/admin/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 502 and r.json()["error"]["code"] == "internal_auth_failed"
            health = c.get("/health").json()
            assert health["status"] == "degraded" and health["router"] == "internal_auth_failed"
    finally:
        router._md = good


async def test_a_proxy_refusing_the_token_is_a_502_on_both_generation_paths() -> None:
    # The proxy's interceptor wants fakes.TOKEN; these pools send another one.
    server, port = await start_grpc(
        FakeProxy("p-auth"), proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server
    )
    address = f"127.0.0.1:{port}"
    request = envelope_pb2.OpenAIRequest(
        envelope=envelope_pb2.Envelope(request_id="r", model="m"), body=b"{}"
    )
    try:
        for streams in (True, False):
            pool = ProxyPool("a-token-the-proxy-does-not-know", streams=streams)
            try:
                with pytest.raises(InternalAuthFailed) as ei:
                    await pool.get(address).chat_completion(request, 5)
                assert ei.value.http_status == 502 and ei.value.code == "internal_auth_failed"
                with pytest.raises(InternalAuthFailed):
                    async for _ in pool.get(address).chat_completion_stream(request, 5):
                        pass
            finally:
                await pool.close()
    finally:
        await server.stop(None)


def test_a_proxy_refusing_the_token_is_refused_at_registration(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str]
) -> None:
    async def other_token_proxy() -> tuple[grpc.aio.Server, int]:
        from fakes import PROXY_SERVICES

        from areal_runtime.auth import InternalTokenInterceptor

        server = grpc.aio.server(interceptors=[InternalTokenInterceptor("another-token-000000")])
        for add in PROXY_SERVICES:
            add(FakeProxy("p-other"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = stack.bg.run(other_token_proxy())
    try:
        proxies = [{"proxy_id": "m-tok-0", "address": f"127.0.0.1:{port}"}]
        r = http.post(
            "/admin/models", headers=admin_headers, json={"name": "m-tok", "proxies": proxies}
        )
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "internal_auth_failed"
        assert "m-tok" not in stack.router.models, "nothing registered"
        stack.register("m-tok2", ["p0"])
        r = http.post(
            "/admin/models/m-tok2/proxies",
            headers=admin_headers,
            json={"proxy_id": "m-tok2-x", "address": f"127.0.0.1:{port}"},
        )
        assert r.status_code == 502 and r.json()["error"]["code"] == "internal_auth_failed"
        assert "m-tok2-x" not in stack.router.proxies
    finally:
        stack.bg.run(server.stop(None))
