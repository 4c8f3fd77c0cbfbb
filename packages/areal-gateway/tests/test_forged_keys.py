"""A session key the gateway did not mint is refused before anything reaches the router.

A recording router (the FAKE router behind an interceptor that logs every RPC, implemented
or not) and a FAKE proxy; gateways served as in conftest.py. A forged key (the right shape
with a bad MAC, the MAC-less shape of old keys, another signer's key, another session's MAC)
gets 401 on every endpoint a session key may call, in both modes, and the router sees no
call at all: nothing is pinned, nothing costs router state. A key the gateway minted works,
also on a second gateway given the same secret (what a restart by the CLI's watchdog is).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fakes import PROXY_SERVICES, TOKEN, BackgroundLoop, FakeProxy, FakeRouter

from areal_gateway.app import create_app
from areal_gateway.runtime import Gateway
from areal_gateway.server import bind_socket, make_server
from areal_gateway.settings import Settings, SettingsError, validate
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime.auth import InternalTokenInterceptor
from areal_runtime.session_keys import KEY_PREFIX, SessionKeys

ADMIN = "session-keys-admin-0123456789"
SECRET = "session-key-secret-for-tests-0123456789abc"
OTHER_SECRET = "another-session-key-secret-0123456789abcd"
MODEL = "m"


class Recorder(grpc.aio.ServerInterceptor):
    """Every RPC that reaches the router, by method name (before any handler runs)."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.methods.append(details.method)
        return await continuation(details)


@dataclass
class Served:
    url: str
    gateway: Gateway
    server: Any
    task: Any


@dataclass
class Env:
    bg: BackgroundLoop
    recorder: Recorder
    proxy: FakeProxy
    inference: Served  # secret SECRET
    restarted: Served  # the same secret: a gateway restarted by the watchdog
    other: Served  # OTHER_SECRET
    agent: Served  # agent mode, secret SECRET


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    bg = BackgroundLoop()
    recorder = Recorder()
    router = FakeRouter()
    proxy = FakeProxy("p0")

    async def setup() -> Any:
        rserver = grpc.aio.server(interceptors=[recorder, InternalTokenInterceptor(TOKEN)])
        router_pb2_grpc.add_RouterServiceServicer_to_server(router, rserver)
        rport = rserver.add_insecure_port("127.0.0.1:0")
        await rserver.start()
        pserver = grpc.aio.server(interceptors=[InternalTokenInterceptor(TOKEN)])
        for add in PROXY_SERVICES:
            add(proxy, pserver)
        pport = pserver.add_insecure_port("127.0.0.1:0")
        await pserver.start()
        return [rserver, pserver], rport, pport

    servers, rport, pport = bg.run(setup())
    router.models[MODEL] = router_pb2.ModelInfo(name=MODEL, kind=router_pb2.MODEL_KIND_INTERNAL)
    router.proxies["p0"] = router_pb2.ProxyInfo(
        proxy_id="p0",
        address=f"127.0.0.1:{pport}",
        model=MODEL,
        kind=router_pb2.PROXY_KIND_INFERENCE,
        health=router_pb2.PROXY_HEALTH_HEALTHY,
    )
    started: list[Served] = []

    def serve(**overrides: Any) -> Served:
        settings = Settings(
            router_addr=f"127.0.0.1:{rport}",
            admin_api_key=ADMIN,
            internal_token=TOKEN,
            request_timeout=30.0,
            drain_timeout=1.0,
            proxy_streams=False,
        )
        settings = dataclasses.replace(settings, **overrides)
        validate(settings)

        async def go() -> Served:
            sock = bind_socket("127.0.0.1", 0)
            app = create_app(settings)
            server = make_server(settings, app)
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
            return Served(
                f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.gateway, server, task
            )

        served = bg.run(go())
        started.append(served)
        return served

    yield Env(
        bg=bg,
        recorder=recorder,
        proxy=proxy,
        inference=serve(session_key_secret=SECRET),
        restarted=serve(session_key_secret=SECRET),
        other=serve(session_key_secret=OTHER_SECRET),
        agent=serve(session_key_secret=SECRET, mode="agent"),
    )

    async def teardown() -> None:
        for s in started:
            s.server.should_exit = True
        await asyncio.gather(*(s.task for s in started), return_exceptions=True)
        for srv in servers:
            await srv.stop(None)

    bg.run(teardown())
    bg.close()


def _forged(env: Env) -> dict[str, str]:
    real = env.inference.gateway.auth.mint_session_key("sess-aaaaaaaaaaaaaaaaaaaaaaaa")
    _, rand, mac = real[len(KEY_PREFIX) :].split(".")
    return {
        "bad mac": f"{KEY_PREFIX}sess-0123456789abcdef01234567.{rand}.{'A' * 22}",
        "no mac (old shape)": f"{KEY_PREFIX}sess-0123456789abcdef01234567.{rand}",
        "another session's mac": f"{KEY_PREFIX}sess-bbbbbbbbbbbbbbbbbbbbbbbb.{rand}.{mac}",
        "truncated": real[:-3],
        "another signer's key": env.other.gateway.auth.mint_session_key("sess-ccc"),
    }


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
INFERENCE_CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "stream": True}),
    ("POST", "/rl/ack_export", {"export_id": "exp-x"}),
    ("GET", "/v1/models", None),
    ("GET", "/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/rl/set_reward", {"reward": 1.0}),
    ("GET", "/rl/sessions/sess-0123456789abcdef01234567", None),
    ("POST", "/rl/end_session", {}),
    ("POST", "/rl/export_trajectories", {}),
    ("POST", "/export_trajectories", {}),
    ("POST", "/rl/start_session", {"group_size": 1}),
    ("GET", "/admin/models", None),
    ("GET", "/admin/admission", None),
    ("PUT", f"/admin/models/{MODEL}/admission", {"max_concurrent_rollouts": 1}),
]
AGENT_SID = "agent-0123456789abcdef01234567"
AGENT_CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/sessions", {}),
    ("DELETE", f"/v1/sessions/{AGENT_SID}", None),
    ("GET", f"/v1/sessions/{AGENT_SID}/history", None),
    ("POST", f"/v1/sessions/{AGENT_SID}/reward", {"reward": 1.0}),
    ("POST", f"/v1/sessions/{AGENT_SID}/export", {}),
    ("POST", f"/v1/sessions/{AGENT_SID}/ack_export", {"export_id": "exp-x"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/responses", {"model": "agent", "input": "hi"}),
    ("POST", "/v1/chat/completions", CHAT),
]


def _call(url: str, key: str, method: str, path: str, body: dict[str, Any] | None) -> Any:
    with httpx.Client(base_url=url, timeout=10) as c:
        return c.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("mode", ["inference", "agent"])
def test_forged_keys_get_401_and_never_reach_the_router(env: Env, mode: str) -> None:
    served, calls = (
        (env.inference, INFERENCE_CALLS)
        if mode == "inference"
        else (
            env.agent,
            AGENT_CALLS,
        )
    )
    forged = _forged(env)
    env.recorder.methods.clear()
    before = len(env.proxy.received)
    for what, key in forged.items():
        for method, path, body in calls:
            r = _call(served.url, key, method, path, body)
            assert r.status_code == 401, (what, method, path, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert env.recorder.methods == []  # no Route, no BindSession, no ListModels: nothing
    assert len(env.proxy.received) == before


def test_minted_key_works_and_survives_a_restart_with_the_same_secret(env: Env) -> None:
    sid = "sess-dddddddddddddddddddddddd"
    key = env.inference.gateway.auth.mint_session_key(sid)
    env.recorder.methods.clear()
    for served in (env.inference, env.restarted):
        r = _call(served.url, key, "POST", "/v1/chat/completions", CHAT)
        assert r.status_code == 200, r.text
        assert env.proxy.received[-1].envelope.session_id == sid
        assert env.proxy.received[-1].envelope.api_key == key  # the proxy checks its hash
        r = _call(served.url, key, "GET", "/v1/models", None)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]
    assert "/areal.router.v1.RouterService/Route" in env.recorder.methods
    # The same key on a gateway with another secret: refused, and nothing routed there.
    env.recorder.methods.clear()
    r = _call(env.other.url, key, "POST", "/v1/chat/completions", CHAT)
    assert r.status_code == 401
    assert env.recorder.methods == []


def test_agent_gateway_verifies_its_own_keys(env: Env) -> None:
    """The agent gateway mints with the same implementation: its key passes the key check
    (the route then asks the router for the session's pair, which this fake has none of)."""
    key = env.agent.gateway.auth.mint_session_key(AGENT_SID)
    assert SessionKeys(SECRET).verify(key) == AGENT_SID
    env.recorder.methods.clear()
    r = _call(env.agent.url, key, "GET", f"/v1/sessions/{AGENT_SID}/history", None)
    assert r.status_code != 401, r.text
    assert env.recorder.methods  # it got past the key check to the router


def test_short_secret_refused_at_start() -> None:
    s = Settings(router_addr="127.0.0.1:1", admin_api_key=ADMIN, session_key_secret="short")
    with pytest.raises(SettingsError, match="AREAL_SESSION_KEY_SECRET"):
        validate(s)
    validate(dataclasses.replace(s, session_key_secret=""))  # none: random per process
