"""A busy engine is not a lost one, and overload is back-pressure.

The proxy in front of an HTTP engine over real sockets (SGLangClient to an aiohttp server
that speaks SGLang's /health and streamed /generate): an engine whose health check stops
answering while its tokens flow stays healthy and SERVING (it was taken for lost: the
proxy went NOT_SERVING under a flood); one whose tokens stop too is stalled after
--engine-stall-timeout; a refused connection is decisive at once. Past --max-inflight a
request is refused 429 `overloaded` with a retry time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_fakes import EOS, FakeEngineClient, error_detail, request, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.engine.sglang import SGLangClient

MSG = [{"role": "user", "content": "hi"}]
SERVING = health_pb2.HealthCheckResponse.SERVING


class Engine:
    """SGLang's /health and streamed /generate; `health_hangs` and `silent` make it busy."""

    def __init__(self) -> None:
        self.health_hangs = False
        self.silent = False
        self.token_interval = 0.05
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_server_info", self._info)
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_hangs:
            await asyncio.sleep(3600)
        return web.Response()

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response({"max_req_input_len": 4000})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = int(body["sampling_params"]["max_new_tokens"])
        prompt = len(body["input_ids"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, n + 1):
            while self.silent:
                await asyncio.sleep(0.05)
            await asyncio.sleep(self.token_interval)
            meta = {
                "completion_tokens": k,
                "prompt_tokens": prompt,
                "output_token_logprobs": [[-0.5, 40 + k % 10, None]],
                "finish_reason": {"type": "length"} if k == n else None,
            }
            event = {"output_ids": [40 + k % 10], "meta_info": meta}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@contextlib.asynccontextmanager
async def _proxy(engine: Engine, **over: Any) -> AsyncIterator[Any]:
    url = await engine.start()
    client = SGLangClient(url, timeout=60, probe_timeout=0.3)
    over = {"engine_url": url, "engine_health_interval": 0.2, **over}
    h = await start(client, **over)  # type: ignore[arg-type]
    try:
        yield h
    finally:
        await h.close()
        await engine.stop()


async def _watch(h: Any, seen: list[tuple[bool, int, bool]], stop: asyncio.Event) -> None:
    """GetStats and grpc.health every 0.1 s, as the router sees them."""
    health = health_pb2_grpc.HealthStub(h.channel)
    while not stop.is_set():
        s = await h.status.GetStats(proxy_pb2.GetStatsRequest(), timeout=2.0)
        r = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        seen.append((s.healthy, r.status, h.server.state.engine_busy))
        await asyncio.sleep(0.1)


async def test_an_engine_whose_health_check_answers_late_while_tokens_flow_stays_serving():
    engine = Engine()
    async with _proxy(engine, engine_stall_timeout=2.0) as h:
        engine.health_hangs = True
        seen: list[tuple[bool, int, bool]] = []
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(h, seen, stop))
        # Four streams of 40 tokens at 20 tokens/s: 2 s of work, the checks time out all along.
        outs = await asyncio.gather(
            *(h.chat_stream({"messages": MSG, "max_tokens": 40}) for _ in range(4))
        )
        stop.set()
        await watcher
        for chunks in outs:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert seen and all(ok and status == SERVING for ok, status, _ in seen), seen
        assert any(busy for _, _, busy in seen), "the late checks were never reported as busy"


async def test_an_engine_silent_past_the_stall_timeout_is_unhealthy():
    engine = Engine()
    async with _proxy(engine, engine_stall_timeout=1.0) as h:
        engine.health_hangs = True
        engine.silent = True
        call = asyncio.ensure_future(h.chat_stream({"messages": MSG, "max_tokens": 5}))
        await asyncio.sleep(0.5)
        assert h.server.state.engine_healthy  # not yet: within the stall timeout
        await wait_for(lambda: not h.server.state.engine_healthy, within=3.0)
        s = await h.status.GetStats(proxy_pb2.GetStatsRequest(), timeout=2.0)
        assert not s.healthy and "stalled" in s.detail, s.detail
        # Tokens again: healthy (busy) at the next check.
        engine.silent = False
        await wait_for(lambda: h.server.state.engine_healthy, within=3.0)
        await call


async def test_a_refused_connection_is_decisive_at_once():
    engine = Engine()
    async with _proxy(engine, engine_stall_timeout=60.0) as h:
        assert h.server.state.engine_healthy
        await engine.stop()
        await wait_for(lambda: not h.server.state.engine_healthy, within=2.0)


async def test_past_max_inflight_a_request_is_refused_with_a_retry_time():
    fake = FakeEngineClient([*range(40, 60), EOS], delay=0.05)
    h = await start(fake, max_inflight=2)
    try:
        running = [
            asyncio.ensure_future(h.chat_stream({"messages": MSG})),
            asyncio.ensure_future(h.chat({"messages": MSG})),
        ]
        await wait_for(lambda: h.server.servicer.active == 2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.ChatCompletion(request({"messages": MSG}))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        d = error_detail(info.value)
        assert (d.http_status, d.code, d.type) == (429, "overloaded", "rate_limit_error")
        assert d.retry_after_s > 0
        await asyncio.gather(*running)
        # Room again: served.
        out = await h.chat({"messages": MSG})
        assert out["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()
