"""One engine transport under both engine clients (engine/transport.py), over real sockets.

What the SGLang and vLLM clients share must behave the same for both: the API key on every
call, the probes of a JSON endpoint, a control call that breaks, a session reopened after
close, and a probe that waits no longer than its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.sglang import SGLangClient
from areal_proxy.engine.transport import EngineTransport
from areal_proxy.engine.vllm import VLLMClient

CLIENTS = {"sglang": SGLangClient, "vllm": VLLMClient}
# Each engine's endpoints for the calls both clients make.
PATHS = {
    "sglang": {"info": "/get_server_info", "generate": "/generate", "pause": "/pause_generation"},
    "vllm": {"info": "/v1/models", "generate": "/v1/completions", "pause": "/pause"},
}
SGLANG_ANSWER = {
    "output_ids": [7],
    "meta_info": {
        "completion_tokens": 1,
        "prompt_tokens": 1,
        "output_token_logprobs": [[-0.1, 7, None]],
        "finish_reason": {"type": "length"},
    },
}
VLLM_ANSWER = {
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.1]},
        }
    ],
    "usage": {"prompt_tokens": 1},
}

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def _engine(kind: str, seen: list[tuple[str, str]], info: Any) -> web.Application:
    """A fake engine that answers every call both clients make and records each call's
    path and Authorization header."""

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization", "")))
        if request.path == PATHS[kind]["info"]:
            return info if isinstance(info, web.StreamResponse) else web.json_response(info)
        if request.path == PATHS[kind]["generate"]:
            return web.json_response(SGLANG_ANSWER if kind == "sglang" else VLLM_ANSWER)
        if request.path == "/weight_info":
            return web.json_response({"weight_version": "1"})
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


def _info(kind: str, limit: int) -> dict[str, Any]:
    if kind == "sglang":
        return {"max_req_input_len": limit}
    return {"data": [{"id": "m", "max_model_len": limit}]}


@pytest.mark.parametrize("kind", CLIENTS)
async def test_every_call_carries_the_api_key(kind: str, serve: Serve):
    seen: list[tuple[str, str]] = []
    client = CLIENTS[kind](await serve(_engine(kind, seen, _info(kind, 4096))), api_key="k3y")
    try:
        assert await client.health()
        assert await client.context_limit() == 4096
        result = await client.generate(GenerationRequest([1], 1))
        assert result.token_ids == [7]
        await client.pause("abort")
        await client.model_info()
    finally:
        await client.close()
    paths = {p for p, _ in seen}
    assert {"/health", PATHS[kind]["info"], PATHS[kind]["generate"], PATHS[kind]["pause"]} <= paths
    assert {auth for _, auth in seen} == {"Bearer k3y"}


@pytest.mark.parametrize("kind", CLIENTS)
async def test_context_limit_reads_the_probe_or_says_none(kind: str, serve: Serve):
    not_served = web.Response(status=404, text="no such endpoint")
    client = CLIENTS[kind](await serve(_engine(kind, [], not_served)))
    try:
        assert await client.context_limit() == 0  # the engine does not say
    finally:
        await client.close()
    unreadable = web.Response(status=200, text="not json")
    client = CLIENTS[kind](await serve(_engine(kind, [], unreadable)))
    try:
        with pytest.raises(EngineError) as info:
            await client.context_limit()
        assert info.value.status == 503
        assert f"engine {PATHS[kind]['info']} failed" in str(info.value)
    finally:
        await client.close()


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_control_call_the_engine_breaks_off_is_a_502(kind: str, serve: Serve):
    async def cut(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()  # connected, then gone without an answer
        await asyncio.sleep(1)
        return web.Response()

    app = web.Application()
    app.router.add_post("/{tail:.*}", cut)
    client = CLIENTS[kind](await serve(app))
    try:
        with pytest.raises(EngineError) as info:
            await client.pause("abort")
    finally:
        await client.close()
    assert info.value.status == 502 and not info.value.retryable, info.value
    assert f"engine {PATHS[kind]['pause']} failed" in str(info.value)


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_closed_client_opens_a_new_session_on_its_next_call(kind: str, serve: Serve):
    client = CLIENTS[kind](await serve(_engine(kind, [], _info(kind, 8))))
    try:
        assert await client.health()
        await client.close()
        assert await client.health()
    finally:
        await client.close()


async def test_a_probe_waits_no_longer_than_its_timeout(serve: Serve):
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", slow)
    transport = EngineTransport(await serve(app), timeout=30, probe_timeout=0.2)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await transport.health() is None  # no answer in time: busy or hung
        assert loop.time() - t0 < 1.5
    finally:
        await transport.close()
